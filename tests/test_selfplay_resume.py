"""A self-play job (two policies) killed with SIGKILL after a checkpoint, resubmitted with the
same name, resumes every policy from the last step they all checkpointed: no step is lost,
no step is logged twice, and the job ends with its full step count."""

from __future__ import annotations

import os

import pytest
from test_resume_kill import kill_after_checkpoint, start_job

pytestmark = pytest.mark.e2e
STEPS = 6
ARGS = [
    "name=duel-kill",
    "warmup.enabled=false",
    f"schedule.steps={STEPS}",
    "schedule.checkpoint_every=2",
    "schedule.eval_every=100",
    "rollout.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.max_new_tokens=3",
    "env.name=gomoku",
    "env.params.size=3",
    "env.params.win_length=3",
    "env.params.move_format=cell",
    "env.params.eval_size=2",
]


def test_sigkilled_selfplay_resumes_every_policy(prefect_api, flowrl_home, tmp_path):
    from prefect.settings import PREFECT_API_URL

    from flowrl.infra.settings import get_settings
    from flowrl.infra.storage import Storage, latest_checkpoint
    from flowrl.infra.tracking import client

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    storage = Storage(get_settings().storage_root)
    prefixes = [f"jobs/duel-kill/agent-{a}/checkpoints" for a in ("X", "O")]

    def checkpointed() -> int | None:  # the last step both policies committed
        steps = [latest_checkpoint(storage, p) for p in prefixes]
        return None if None in steps else min(steps)

    first = start_job("selfplay", ARGS, env, tmp_path / "first.log")
    killed_after = kill_after_checkpoint(first, checkpointed, tmp_path / "first.log")
    assert killed_after < STEPS

    second = start_job("selfplay", ARGS, env, tmp_path / "second.log")
    assert second.wait(600) == 0, (tmp_path / "second.log").read_text()[-3000:]

    result = storage.read_json("jobs/duel-kill/result.json")
    assert result["steps"] == STEPS and result["resumed_from"] >= killed_after
    assert [latest_checkpoint(storage, p) for p in prefixes] == [STEPS, STEPS]
    history = client().get_metric_history(result["mlflow_run_id"], "agent-X/outcome")
    steps = [m.step for m in history]
    # Every step once: the steps after the checkpoint ran again, but what the killed run had
    # already sent for them is not logged a second time.
    assert sorted(steps) == list(range(1, STEPS + 1)), (killed_after, steps)
    assert {"X", "O"} == set(result["model_uris"])
