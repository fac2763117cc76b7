"""Every deployment of ``prefect.yaml`` run as a Prefect user runs it: applied by flowrl's own
deploy code, submitted through ``flowrl jobs submit`` or the Prefect client, picked up by the
local stack's real process worker, whose flow-run processes use the stack's Ray head, MLflow
server and S3 (moto). Each job is small (a few steps of a tiny model) and is judged by what it
left: states in Prefect, registered versions and aliases in MLflow, checkpoints in S3.

The deployments are applied from a copy of ``prefect.yaml`` that only moves them onto the
test pool's queue ``hi`` (entrypoints, parameters and descriptions unchanged).
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from flowrl.infra.client import JobClient

pytestmark = pytest.mark.e2e

RL_OVERRIDES = [
    "warmup.enabled=false",
    "schedule.steps=2",
    "schedule.eval_every=2",
    "schedule.checkpoint_every=1",
    "rollout.prompts_per_step=4",
    "rollout.group_size=2",
    "env.params.eval_size=8",
]


def _overrides(*extra: str) -> list[str]:
    out = []
    for item in [*RL_OVERRIDES, *extra]:
        out += ["--set", item]
    return out


@pytest.fixture
def deployed(stack_env, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """prefect.yaml's deployments on the test pool; returns name -> ``flow/deployment``."""
    from flowrl.infra.deployments import PREFECT_YAML, apply_deployments
    from flowrl.infra.scheduler import load_scheduler

    os.environ["FLOWRL_SCHEDULER_FILE"] = stack_env.env["FLOWRL_SCHEDULER_FILE"]
    try:
        spec = load_scheduler()
    finally:
        os.environ.pop("FLOWRL_SCHEDULER_FILE")
    data = yaml.safe_load(PREFECT_YAML.read_text())
    for d in data["deployments"]:
        d["work_pool"] = {"name": spec.pool.name, "work_queue_name": "hi"}
        d.pop("schedules", None)  # no cron runs on the shared test server
    copy = tmp_path_factory.mktemp("deploy") / "prefect.yaml"
    copy.write_text(yaml.safe_dump(data))
    lines = apply_deployments(spec, copy)
    names = {line.split()[1].split("/", 1)[1]: line.split()[1] for line in lines}
    assert set(names) == {d["name"] for d in data["deployments"]}
    return names


def _submit_cli(capsys, deployment: str, *args: str) -> str:
    from flowrl.cli import main

    assert main(["jobs", "submit", deployment, *args]) == 0, capsys.readouterr().err
    return capsys.readouterr().out.strip().splitlines()[-1]


def _submit_as_the_form(deployment: str, parameters: dict) -> str:
    """A run created as the Prefect UI's Custom run form creates one: by deployment id, with
    no name (the server gives it a random one) and no admission check."""
    from prefect import get_client

    with get_client(sync_client=True) as c:
        deployment_id = c.read_deployment_by_name(deployment).id
        return str(c.create_flow_run_from_deployment(deployment_id, parameters=parameters).id)


def _logs(run_id: str) -> list[str]:
    """The flow run's log lines as Prefect has them."""
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as c:
        found = c.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(run_id)])), limit=200
        )
    return [log.message for log in found]


def _artifacts(run_id: str) -> list:
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as c:
        return c.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[UUID(run_id)]))
        )


def _wait_all(jobs: JobClient, runs: dict[str, str], timeout: float = 480) -> None:
    for name, run_id in runs.items():
        status = jobs.wait(run_id, timeout=timeout)
        assert status.state == "COMPLETED", (name, status.message, _logs(run_id)[-8:])


def _result(storage, job: str) -> dict:
    return storage.read_json(f"jobs/{job}/result.json")


def test_every_deployment_runs_on_the_worker(deployed, stack_env, capsys, tmp_path):
    from flowrl.infra import tracking
    from flowrl.infra.settings import get_settings
    from flowrl.infra.storage import Storage, latest_checkpoint

    jobs = JobClient()
    storage = Storage(get_settings().storage_root)  # the stack's S3 bucket

    # Round 1 (pool limit 2, so these queue up): RL full and LoRA through the CLI, SFT as the
    # Prefect UI's form submits, self-play through flowrl's JobClient (over run_deployment).
    chat = tmp_path / "chat.jsonl"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"{a}+1="},
                {"role": "assistant", "content": str(a + 1)},
            ]
        }
        for a in range(40)
    ]
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs = {
        "rl-train": _submit_cli(capsys, "rl-train", *_overrides("name=dep-rl")),
        "rl-train-lora": _submit_cli(capsys, "rl-train-lora", *_overrides("name=dep-lora")),
        "sft-train": _submit_as_the_form(
            deployed["sft-train"],
            {
                "config": {
                    "name": "dep-sft",
                    "data": {"train": str(chat), "eval_size": 8},
                    "train": {"steps": 2, "eval_every": 2, "batch_size": 4},
                }
            },
        ),
        "self-play": jobs.submit(
            "self-play",
            {
                "config": {
                    "name": "dep-selfplay",
                    "env": {
                        "name": "gomoku",
                        "params": {"size": 3, "win_length": 3, "eval_size": 4},
                    },
                    "warmup": {"enabled": False},
                    "rollout": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 4},
                    "schedule": {"steps": 1, "eval_every": 1, "checkpoint_every": 1},
                }
            },
        ),
    }
    _wait_all(jobs, runs)

    rl = _result(storage, "dep-rl")
    assert rl["model_uri"] == "models:/dep-rl/1"
    # What the Prefect user sees of a run on the worker: its stage lines and its artifacts.
    lines = _logs(runs["rl-train"])
    assert any(line.startswith("warm-up: ") for line in lines), lines[-10:]
    assert any("registered models:/dep-rl/1" in line for line in lines), lines[-10:]
    kinds = {a.type for a in _artifacts(runs["rl-train"])}
    assert {"progress", "markdown", "table"} <= kinds, kinds
    lora = _result(storage, "dep-lora")
    step = latest_checkpoint(storage, "jobs/dep-lora/checkpoints")
    assert step == 2
    from safetensors.torch import load as load_safetensors

    adapter = load_safetensors(
        storage.read_bytes(f"jobs/dep-lora/checkpoints/step-{step:08d}/weights.safetensors")
    )
    assert adapter and all("lora_" in k for k in adapter), sorted(adapter)[:5]  # adapter only
    assert lora["model_uri"] == "models:/dep-lora/1"
    assert _result(storage, "dep-sft")["model_uri"] == "models:/dep-sft/1"
    assert jobs.status(runs["sft-train"]).name == "dep-sft"  # the form's run: the job's name
    assert set(_result(storage, "dep-selfplay")["model_uris"]) == {"X", "O"}

    # Round 2: batch inference with the registered RL model; retraining from its champion.
    c = tracking.client()
    c.set_registered_model_alias("dep-rl", "champion", "1")
    retrain_job = {
        "name": "dep-retrain",
        "register_as": "dep-rl",
        "warmup": {"enabled": False},
        "env": {"params": {"eval_size": 8}},
        "rollout": {"prompts_per_step": 4, "group_size": 2},
        "schedule": {"steps": 2, "eval_every": 2, "checkpoint_every": 2},
    }
    runs = {
        "batch-inference": _submit_cli(
            capsys,
            "batch-inference",
            "--set",
            "name=dep-infer",
            "--set",
            "model.source=models:/dep-rl@champion",
            "--set",
            "num_prompts=8",
            "--set",
            "env.params.eval_size=8",
        ),
        "retrain": jobs.submit("retrain", {"config": {"job": retrain_job}}),
        "evaluate": jobs.submit(
            "evaluate",
            {
                "config": {
                    "name": "dep-eval",
                    "models": ["models:/dep-rl/1"],
                    "envs": [{"name": "arithmetic", "params": {"eval_size": 8}}],
                    "samples": 2,
                    "k": [1, 2],
                }
            },
        ),
    }
    _wait_all(jobs, runs)
    infer = _result(storage, "dep-infer")
    assert infer["num_episodes"] == 8
    (scores,) = _result(storage, "dep-eval")["scores"]  # one model, one environment
    assert scores[0]["prompts"] == 8 and set(scores[0]["pass_at"]) == {"1", "2"}
    evaluated = c.get_model_version("dep-rl", "1").tags
    assert evaluated["flowrl.eval.run_id"] and "flowrl.eval.arithmetic.pass_at_2" in evaluated
    # The gate's decision is recorded on the challenger (version 2): the alias follows it.
    challenger = c.get_model_version("dep-rl", "2")
    decision = challenger.tags["flowrl.retrain.decision"]
    assert challenger.tags["flowrl.retrain.champion_version"] == "1"
    champion = tracking.alias_version("dep-rl", "champion")
    if decision == "promoted":
        assert champion == "2"
    else:
        assert decision == "kept" and champion == "1", decision
