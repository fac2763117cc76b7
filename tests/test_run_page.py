"""What a run's Prefect page shows of a long job, without training one: a flow drives the real
``JobRun`` (real Prefect API, real MLflow store) through 240 steps of made-up metrics, as the
RL flow logs them. The page's log has at most ~50 step lines, the results table one row per
step with the same columns in every row, the curve a few versions, and the run the job's name
although its config arrived as a dict (as from the UI's form)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest
from prefect import flow

from flowrl.flows.lifecycle import JobRun
from flowrl.flows.rl import COLUMNS
from flowrl.flows.run_page import job_run_name
from flowrl.tasks.schemas import RLJobConfig

pytestmark = pytest.mark.e2e

STEPS = 240
EVAL_EVERY = 100


@dataclass(frozen=True)
class Result:
    job: str
    mlflow_run_id: str


@flow(name="run-page-probe", flow_run_name=job_run_name(RLJobConfig))
def made_up_job(config: RLJobConfig, stop_after: int = STEPS) -> Result:
    """The RL flow's records without its work: reward rises, loss falls, an evaluation before
    step 1, at every 100th step and after the last (``final/accuracy``); one update skipped.
    With ``stop_after`` it ends there, unfinished, as a killed job would; the next submission
    of the job continues its MLflow run, logging again only what was not logged."""
    with JobRun(config, resume=True, columns=COLUMNS) as job:
        with job.phase("evaluation before RL") as phase:
            job.log({"eval/accuracy": 0.25}, step=0)
            phase.result = "held-out accuracy 0.250"
        for step in job.steps(0, STEPS):
            if step == stop_after:
                return Result(config.name, job.run_id)
            update = {"train/loss": 1.0 / (step + 1)} if step != 7 else {"train/skipped": 1.0}
            job.log({"reward/mean": step / STEPS, "time/step_s": 0.5} | update, step + 1)
            if (step + 1) % EVAL_EVERY == 0:
                job.log({"eval/accuracy": 0.5}, step + 1)
            job.advance(step + 1)
        job.log({"final/accuracy": 0.75}, STEPS)
        result = Result(config.name, job.run_id)
        job.finish(result)
    return result


@pytest.fixture(scope="module")
def ran(prefect_api, flowrl_home):
    state = made_up_job(config={"name": "run-page", "resources": {"gpus": 0}}, return_state=True)
    assert state.is_completed(), state
    return state.state_details.flow_run_id, state.result()


def _read(flow_run_id):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.client.schemas.sorting import LogSort
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id]))
        )
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])),
            limit=200,
            sort=LogSort.TIMESTAMP_ASC,
        )
    return run, artifacts, [log.message for log in logs]


def test_a_run_from_a_dict_config_is_named_after_its_job(ran):
    flow_run_id, _ = ran
    run, _, _ = _read(flow_run_id)
    assert run.name == "run-page"


def test_a_long_job_logs_a_step_line_every_k_steps_and_at_each_evaluation(ran):
    import time

    flow_run_id, _ = ran
    for _ in range(30):  # the last lines reach the API a moment after the flow returns
        _, _, lines = _read(flow_run_id)
        if any(line.startswith(f"step {STEPS}/") for line in lines):
            break
        time.sleep(1.0)
    steps = [int(m.group(1)) for line in lines if (m := re.match(r"step (\d+)/240: ", line))]
    k = STEPS // 50  # 4
    assert steps == sorted({*range(k, STEPS + 1, k), 100, 200}), steps
    by_step = {
        int(line.split()[1].split("/")[0]): line for line in lines if line.startswith("step ")
    }
    assert by_step[100] == "step 100/240: reward 0.412, loss 0.0100, 0.50 s/step, accuracy 0.500"
    assert by_step[8] == "step 8/240: reward 0.029, 0.50 s/step"  # the update was skipped
    assert "evaluation before RL: started" in lines
    assert any(
        re.fullmatch(r"evaluation before RL: held-out accuracy 0.250 \(\d+\.\d s\)", m)
        for m in lines
    )


def test_the_results_table_has_the_same_columns_in_every_row(ran):
    flow_run_id, _ = ran
    _, artifacts, _ = _read(flow_run_id)
    (table,) = [a for a in artifacts if a.key == "run-page-results"]
    rows = table.data if isinstance(table.data, list) else json.loads(table.data)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # no row 0: no training
    assert all(list(r) == ["step", "reward/mean", "accuracy", "loss", "seconds"] for r in rows)
    evaluated = {r["step"]: r["accuracy"] for r in rows if r["accuracy"] is not None}
    assert evaluated == {100: 0.5, 200: 0.5, STEPS: 0.75}
    assert [r["step"] for r in rows if r["loss"] is None] == [8]  # the skipped update
    assert rows[99]["reward/mean"] == round(99 / STEPS, 4) and rows[0]["seconds"] == 0.5


def test_the_curve_is_redrawn_every_tenth_of_the_steps_and_at_each_evaluation(ran):
    flow_run_id, _ = ran
    _, artifacts, _ = _read(flow_run_id)
    curves = [a for a in artifacts if a.key == "run-page-curve"]
    # every 24 steps (10), the evaluations at 100 and 200 (2) and the final drawing (1)
    assert len(curves) == 13, len(curves)
    assert all("](data:image/svg+xml;base64," in a.data for a in curves)


def test_a_continued_runs_table_holds_the_steps_of_its_earlier_submission(prefect_api, flowrl_home):
    """A resubmitted job continues its MLflow run and logs none of the steps already there:
    its table and curve still show them (read back from the run)."""
    config = {"name": "run-page-resumed", "resources": {"gpus": 0}}
    first = made_up_job(config=config, stop_after=120)
    second = made_up_job(config=config, return_state=True)
    assert second.result().mlflow_run_id == first.mlflow_run_id
    _, artifacts, _ = _read(second.state_details.flow_run_id)
    (table,) = [a for a in artifacts if a.key == "run-page-resumed-results"]
    rows = table.data if isinstance(table.data, list) else json.loads(table.data)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert rows[49]["reward/mean"] == round(49 / STEPS, 4) and rows[99]["accuracy"] == 0.5


def test_an_experiment_made_before_flowrl_tagged_them_becomes_a_training_one(flowrl_home):
    """The MLflow UI's kind of an experiment flowrl logs to is model training, also for one
    created without the tag (by an older flowrl, or by hand); a kind set by hand is kept."""
    from flowrl.infra import tracking

    c = tracking.client()
    untagged = c.create_experiment("made-by-hand")
    chosen = c.create_experiment(
        "chosen-kind", tags={tracking.EXPERIMENT_KIND_TAG: "genai_development"}
    )
    assert tracking.experiment_id("made-by-hand") == untagged
    assert tracking.experiment_id("chosen-kind") == chosen
    assert (
        c.get_experiment(untagged).tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
    )
    assert c.get_experiment(chosen).tags[tracking.EXPERIMENT_KIND_TAG] == "genai_development"
