"""A user's environment that says where it runs, named ``tests.sample_envs:Whereabouts``:
importable from the repository root, so by this process and its Ray workers (Ray puts the
driver's working directory on their path)."""

from __future__ import annotations

import os
import time

from flowrl.environments.types import StepResult

WHEREABOUTS = "tests.sample_envs:Whereabouts"


class Whereabouts:
    """One turn: any answer of at least two characters gets reward 1. ``info`` holds the
    process id of the process the episode was played in. A row ``fail="step"`` raises in
    ``step``; ``hang="step"`` sleeps ``hang_s`` there."""

    def __init__(self, hang_s: float = 60.0) -> None:
        self.hang_s = hang_s
        self.row: dict[str, object] = {}

    def reset(self, seed: int = 0, fail: str = "", hang: str = "") -> str:
        self.row = {"fail": fail, "hang": hang}
        return f"Say something ({seed})."

    def step(self, action: str) -> StepResult:
        if self.row["fail"] == "step":
            raise RuntimeError("the environment failed in step")
        if self.row["hang"] == "step":
            time.sleep(self.hang_s)
        reward = float(len(action.strip()) >= 2)
        return StepResult("", reward, True, {"pid": os.getpid(), "correct": reward > 0})

    def get_system_prompt(self) -> str:
        return ""

    def get_initial_user_message(self) -> str:
        return "Say something."
