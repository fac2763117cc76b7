"""A user's environment whose ``reset`` or ``step`` can hang (an external tool call that never
returns), named ``tests.hangs:Hanging``: importable from the repository root, so by this
process, its Ray workers (Ray puts the driver's working directory on their path) and the
environment service started there."""

from __future__ import annotations

import os
import time
from pathlib import Path

from flowrl.environments.plugin import TRAIN_SEED_SPACING
from flowrl.environments.types import StepResult

HUNG = "tests.hangs:Hanging"


class Hanging:
    """One turn: any answer ends the episode with reward 1. The episode hangs (sleeps
    ``hang_s``) in ``reset`` or ``step`` when its row says ``hang="reset"`` / ``"step"``, or,
    with ``hang_every`` = k and a folder ``claims``, in ``step`` for ONE episode of each
    generated training row whose seed is 1 modulo k (the first episode to claim the seed in
    ``claims`` hangs; its group's others do not). ``delay_s``: every reset takes this long.
    ``evaluating``: a folder; a held-out row's reset writes ``evaluating`` there and hangs.
    ``eval_hang_every`` = k: a held-out row whose seed is 1 modulo k hangs in ``step``."""

    def __init__(
        self,
        hang_s: float = 3600.0,
        delay_s: float = 0.0,
        hang_every: int = 0,
        claims: str = "",
        evaluating: str = "",
        eval_hang_every: int = 0,
    ) -> None:
        self.hang_s, self.delay_s = hang_s, delay_s
        self.hang_every, self.claims = hang_every, claims
        self.evaluating, self.eval_hang_every = evaluating, eval_hang_every
        self.hang = ""

    def reset(self, seed: int = 0, hang: str = "") -> str:
        self.hang = hang or ("step" if self._claims(seed) else "")
        if self.evaluating and seed < TRAIN_SEED_SPACING:
            (Path(self.evaluating) / "evaluating").touch()
            self.hang = "reset"
        k = self.eval_hang_every
        if k and seed < TRAIN_SEED_SPACING and seed % k == 1 % k:
            self.hang = "step"
        time.sleep(self.delay_s)
        if self.hang == "reset":
            time.sleep(self.hang_s)
        return f"Say ok ({seed})."

    def step(self, action: str) -> StepResult:
        if self.hang == "step":
            time.sleep(self.hang_s)
        return StepResult("", 1.0, True, {"correct": True})

    def get_system_prompt(self) -> str:
        return ""

    def get_initial_user_message(self) -> str:
        return "Say ok."

    def _claims(self, seed: int) -> bool:
        if not self.hang_every or seed < TRAIN_SEED_SPACING or seed % self.hang_every != 1:
            return False
        try:
            os.close(os.open(Path(self.claims) / str(seed), os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return False
        return True
