"""The rl-train flow end to end on a tiny model: real Prefect API, real Ray, real MLflow store.

One short job runs once for the module (fixed seeds); the tests read what a user would read:
the flow's result, the MLflow run and registry, the stored checkpoints.
"""

from __future__ import annotations

import base64
import json
import re
import statistics
from xml.etree import ElementTree

import pytest
import torch
from services import metric_history

from flowrl.tasks.schemas import load_job

pytestmark = pytest.mark.e2e

STEPS = 80
RESULT_COLUMNS = ["reward/mean", "accuracy", "loss", "seconds"]


@pytest.fixture(scope="module")
def trained(prefect_api, flowrl_home):
    from flowrl.flows.rl import rl_train

    config = load_job(
        None,
        [
            "name=arithmetic-e2e",
            f"schedule.steps={STEPS}",
            "schedule.eval_every=40",
            "schedule.checkpoint_every=40",
            "rollout.prompts_per_step=32",
        ],
    )
    return config, rl_train(config)


def test_reward_rises_with_fixed_seeds(trained):
    _, result = trained
    rewards = metric_history(result.mlflow_run_id, "reward/mean")
    assert len(rewards) == STEPS
    first, last = statistics.mean(rewards[:20]), statistics.mean(rewards[-20:])
    print(f"reward/mean first 20 steps {first:.3f}, last 20 {last:.3f}")
    assert last > first + 0.05, (first, last)
    assert result.accuracy_end > result.accuracy_start


def test_mlflow_run_has_per_step_metrics_and_artifacts(trained):
    from flowrl.infra.tracking import client

    _, result = trained
    run = client().get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    for metric in (
        "reward/mean",
        "train/loss",
        "rollout/tokens_per_s",
        "time/step_s",
        "time/rollout_s",
        "time/update_s",
    ):
        assert len(metric_history(result.mlflow_run_id, metric)) == STEPS, metric
    assert run.data.params["rollout.group_size"] == "8"
    artifacts = {a.path for a in client().list_artifacts(result.mlflow_run_id)}
    assert {"reward_curve.svg", "samples", "policy"} <= artifacts


def test_registered_version_loads_by_uri_and_reproduces_final_accuracy(trained, flowrl_home):
    from flowrl.backends.models.chat import HFChatFormat
    from flowrl.backends.models.model_folder import load_causal_lm, load_tokenizer
    from flowrl.backends.models.model_uri import resolve_model_uri
    from flowrl.backends.policy.actors import start_policy, stop_policy
    from flowrl.backends.types import WorkerSpec
    from flowrl.tasks.episodes import evaluate_policy

    config, result = trained
    assert result.model_uri.startswith("models:/arithmetic-e2e/")
    path = resolve_model_uri(result.model_uri, str(flowrl_home / "load-cache"))
    model, tok = load_causal_lm(path), load_tokenizer(path)
    prompt = HFChatFormat(tok).encode_prompt([{"role": "user", "content": "12+3="}])
    out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    assert out.shape[1] > len(prompt)  # it generates

    policy = start_policy(
        "reload", WorkerSpec(model_uri=result.model_uri, cache_dir=str(flowrl_home)), local=True
    )
    try:
        chat = HFChatFormat(tok)
        again = evaluate_policy(config.env.task(), policy, chat, config.rollout.limits(greedy=True))
    finally:
        stop_policy(policy)
    assert again.accuracy == pytest.approx(result.accuracy_end)


def test_checkpoints_are_committed_under_the_job_prefix(trained, flowrl_home):
    from flowrl.infra.settings import get_settings
    from flowrl.infra.storage import Storage, latest_checkpoint

    _, result = trained
    storage = Storage(get_settings().storage_root)
    assert latest_checkpoint(storage, "jobs/arithmetic-e2e/checkpoints") == STEPS
    assert storage.read_json("jobs/arithmetic-e2e/result.json")["model_uri"] == result.model_uri


def test_second_run_skips_the_cached_warmup(trained):
    from flowrl.infra.settings import get_settings
    from flowrl.tasks.model import prepare_model, warmup
    from flowrl.tasks.types import JobContext

    config, _ = trained
    s = get_settings()
    ctx = JobContext(config.name, s.storage_root, s.model_cache_dir, run_name="cache-check")
    base_uri = prepare_model.fn(config, ctx)
    again = warmup.fn(config, ctx, base_uri)  # would start actors and train if not cached
    assert again.cached is True
    assert again.accuracy >= config.warmup.target_accuracy


def _run_logs(flow_run_id, wanted: str, wait_s: float = 90.0) -> tuple[list, list]:
    """The flow run's newest and oldest 200 log lines, once a line containing `wanted` has
    reached the API. Prefect ships logs from a background worker in batches: on a loaded
    machine the run's last lines arrive seconds after the flow returns, so flush and poll."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    only_this_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while True:
            newest = client.read_logs(  # the run's last lines (there are hundreds of task runs)
                log_filter=only_this_run, limit=200, sort=LogSort.TIMESTAMP_DESC
            )
            if any(wanted in log.message for log in newest) or time.monotonic() > deadline:
                break
            time.sleep(2.0)
        oldest = client.read_logs(log_filter=only_this_run, limit=200, sort=LogSort.TIMESTAMP_ASC)
    return newest, oldest


def test_prefect_has_the_runs_logs_and_artifacts(trained):
    """What a Prefect user opens: the flow run's logs (the stage lines), its results table
    (one row per step: reward, accuracy), a markdown summary, a link to the MLflow run and
    the progress artifact at 100 %."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    _, result = trained
    with get_client(sync_client=True) as client:
        table = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["arithmetic-e2e-results"]))
        )
        assert table, "no results table"
        flow_run_id = table[0].flow_run_id
        artifacts = client.read_artifacts()
    logs, first = _run_logs(flow_run_id, "registered " + result.model_uri)
    data = table[0].data
    rows = data if isinstance(data, list) else json.loads(data)
    # One row per RL step, every row with the same columns in the same order (Prefect takes
    # the table's columns from its first row); accuracy only where an evaluation ran.
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert all(list(row) == ["step", *RESULT_COLUMNS] for row in rows), rows[0]
    for column in ("reward/mean", "loss", "seconds"):
        assert all(isinstance(row[column], float) for row in rows), column
    assert all(row["seconds"] > 0 for row in rows)
    assert len({row["reward/mean"] for row in rows}) > 10  # the rewards of the steps
    assert [row["step"] for row in rows if row["accuracy"] is not None] == [40, STEPS]
    assert rows[-1]["accuracy"] == pytest.approx(result.accuracy_end, abs=1e-4)
    mine = [a for a in artifacts if a.flow_run_id == flow_run_id]
    by_type = {a.type for a in mine}
    assert {"table", "markdown", "progress"} <= by_type, by_type
    link = next(a for a in mine if a.key == "arithmetic-e2e-mlflow")
    assert result.mlflow_run_id in str(link.data)
    summary = next(a for a in mine if a.key == "arithmetic-e2e-summary")
    assert result.model_uri in str(summary.data)
    assert next(a for a in mine if a.type == "progress").data == 100.0
    messages = [log.message for log in logs]
    assert any("registered " + result.model_uri in m for m in messages), messages[:20]
    assert any(log.message.startswith("warm-up") for log in first), [g.message for g in first][:20]
    # RL restarted the warm-up's workers from the warmed model: no second pair of processes.
    handed = [g.message for g in first if g.message.startswith("policy workers: warm-up's")]
    assert handed and "/warmup-" in handed[0], [g.message for g in first][:20]


def _flow_lines(flow_run_id) -> list[str]:
    """Every line the flow itself logged (not its task runs'), oldest first."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.client.schemas.sorting import LogSort

    only_this_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
    logs: list = []
    with get_client(sync_client=True) as client:
        while True:
            page = client.read_logs(
                log_filter=only_this_run, limit=200, offset=len(logs), sort=LogSort.TIMESTAMP_ASC
            )
            logs += page
            if len(page) < 200:
                break
    return [log.message for log in logs if log.task_run_id is None]


def test_the_runs_log_reads_step_by_step_and_phase_by_phase(trained):
    """The flow run's own log: the start and end of each phase in words, one line per step
    with its reward, loss and seconds (and accuracy where evaluated), no repr dumps."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    _, result = trained
    with get_client(sync_client=True) as client:
        (table,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["arithmetic-e2e-results"]))
        )
    _run_logs(table.flow_run_id, "registered " + result.model_uri)  # the last lines are in
    lines = _flow_lines(table.flow_run_id)
    assert not [line for line in lines if "WarmupResult(" in line or "PolicyRef(" in line]
    step_lines = [line for line in lines if re.match(r"step \d+/\d+: ", line)]
    # 80 steps log every step (a longer job every steps // 50); each gives what a user reads.
    assert len(step_lines) == STEPS, step_lines[:3]
    for line in step_lines:
        assert re.fullmatch(
            r"step \d+/80: reward -?\d\.\d{3}, loss -?\d+\.\d{4}, \d+\.\d{2} s/step"
            r"(, accuracy \d\.\d{3})?",
            line,
        ), line
    assert sum(", accuracy " in line for line in step_lines) == 1  # step 40; 80: final eval
    assert step_lines[39].startswith("step 40/80: ") and ", accuracy " in step_lines[39]
    phases = [line for line in lines if re.match(r"(warm-up|evaluation|RL|final|registr)", line)]
    print("\n".join(["", *phases[:5], *step_lines[38:41], *phases[5:]]))
    expected = [
        r"warm-up: SFT on the environment's demonstrations until held-out accuracy 0\.\d+.*",
        r"warm-up: (done|reused an earlier job's warm-up): held-out accuracy \d\.\d{3} after "
        r"\d+ SFT steps \(\d+\.\d s\)",
        r"evaluation before RL: started",
        r"evaluation before RL: held-out accuracy \d\.\d{3} \(\d+\.\d s\)",
        r"RL: steps 1-80, fresh start",
        r"RL: done, 80 steps \(\d+\.\d s\)",
        r"final evaluation: started",
        rf"final evaluation: held-out accuracy {result.accuracy_end:.3f} "
        rf"\({result.accuracy_start:.3f} before RL\) \(\d+\.\d s\)",
        r"registration: as a version of arithmetic-e2e",
        rf"registration: registered {result.model_uri} \(\d+\.\d s\)",
    ]
    assert len(phases) == len(expected), phases
    for line, pattern in zip(phases, expected, strict=True):
        assert re.fullmatch(pattern, line), (line, pattern)
    # The phases frame the steps: warm-up and the first evaluation before them, the rest after.
    assert lines.index(phases[4]) < lines.index(step_lines[0])
    assert lines.index(step_lines[-1]) < lines.index(phases[5])


def test_the_curve_artifact_is_a_picture_updated_as_the_job_ran(trained):
    """``<job>-curve``: a markdown artifact embedding a PNG of reward and accuracy, one version
    at each evaluation and every tenth of the steps, the last at the end."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        versions = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["arithmetic-e2e-curve"]))
        )
    # every 8 steps (40 is also the evaluation's), and the final drawing
    assert len(versions) == STEPS // 8 + 1, len(versions)
    latest = max(versions, key=lambda a: a.created)
    found = re.search(r"!\[curve\]\(data:image/svg\+xml;base64,([A-Za-z0-9+/=]+)\)", latest.data)
    assert found, latest.data[:200]
    svg = ElementTree.fromstring(base64.b64decode(found.group(1)))
    legend = [t.text for t in svg.iter("{http://www.w3.org/2000/svg}text")]
    assert {"reward/mean", "accuracy"} <= set(legend), legend  # a line and a legend entry each
    assert len(list(svg.iter("{http://www.w3.org/2000/svg}polyline"))) >= 2
    assert "final: 80 steps" in latest.data


def test_mlflow_shows_a_training_experiment_and_the_runs_logged_model(trained):
    """MLflow's UI opens the experiment as model training (the kind tag), and the run lists
    its registered model among its outputs ("Logged models" on the run's page)."""
    from flowrl.infra.tracking import client

    config, result = trained
    c = client()
    run = c.get_run(result.mlflow_run_id)
    experiment = c.get_experiment(run.info.experiment_id)
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    version = c.get_model_version("arithmetic-e2e", result.model_uri.rsplit("/", 1)[1])
    outputs = run.outputs.model_outputs
    assert [f"models:/{o.model_id}" for o in outputs] == [version.source], outputs
    assert outputs[0].step == STEPS  # the step of the final metrics it was registered with
