"""configs/geometry.yaml end to end, shortened: the rl-train flow on real Prefect, Ray and MLflow
runs a tiny LLaVA on figures (rollouts, updates, evals), records the accuracy and registers a
policy that reloads as a vision-language model with its processor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flowrl.tasks.schemas import load_job

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[1]
STEPS = 2


@pytest.fixture(scope="module")
def trained(prefect_api, flowrl_home):
    from flowrl.flows.rl import rl_train

    config = load_job(
        REPO / "configs" / "geometry.yaml",
        [
            "name=geometry-e2e",
            f"schedule.steps={STEPS}",
            "schedule.eval_every=1",
            "schedule.checkpoint_every=2",
            "rollout.prompts_per_step=4",
            "rollout.group_size=2",
            "warmup.enabled=false",  # SFT with images: tests/test_vlm.py (two actors less here)
            "env.params.eval_size=8",
        ],
    )
    return config, rl_train(config)


def test_the_flow_records_accuracy_and_trains_on_figures(trained):
    from flowrl.infra.tracking import client

    _, result = trained
    run = client().get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    history = {
        metric: sorted(
            (m.step, m.value) for m in client().get_metric_history(run.info.run_id, metric)
        )
        for metric in ("eval/accuracy", "final/accuracy", "reward/accuracy", "train/loss")
    }
    assert [step for step, _ in history["eval/accuracy"]] == [0, 1]
    assert [step for step, _ in history["final/accuracy"]] == [STEPS]
    assert len(history["reward/accuracy"]) == len(history["train/loss"]) == STEPS
    assert all(0.0 <= value <= 1.0 for _, value in history["eval/accuracy"])
    assert history["final/accuracy"][0][1] == pytest.approx(result.accuracy_end)

    # The transcripts show the figure as an image part of the user message.
    sample = client().download_artifacts(run.info.run_id, "samples/step-00001.json")
    first = json.loads(Path(sample).read_text())[0]["messages"][0]
    assert first["role"] == "user" and first["content"][0] == {"type": "image"}


def test_the_registered_policy_reloads_as_a_vision_language_model(trained, flowrl_home):
    from flowrl.backends.models.model_folder import load_causal_lm
    from flowrl.backends.models.model_uri import resolve_model_uri
    from flowrl.backends.models.vlm import image_seq_length

    _, result = trained
    assert result.model_uri == "models:/geometry-e2e/1"
    path = resolve_model_uri(result.model_uri, str(flowrl_home / "load-cache"))
    assert type(load_causal_lm(path)).__name__ == "LlavaForConditionalGeneration"
    assert image_seq_length(path) == 16  # the processor came along: 32 px / 8 px patches
