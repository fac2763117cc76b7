"""Batch inference with a registered model through the training environment and agent loop:
episodes land as JSONL under the job's storage prefix, their scores in MLflow."""

from __future__ import annotations

import json

import pytest

from flowrl.tasks.jobs import load_job

pytestmark = pytest.mark.e2e


def test_batch_inference_writes_scored_episodes_and_metrics(prefect_api, flowrl_home):
    from flowrl.flows.inference import batch_inference
    from flowrl.flows.rl import rl_train
    from flowrl.infra.settings import get_settings
    from flowrl.infra.storage import Storage
    from flowrl.infra.tracking import client
    from flowrl.tasks.jobs import InferenceJobConfig

    source = load_job(
        None,
        [
            "name=inference-src",
            "warmup.enabled=false",
            "schedule.steps=1",
            "rollout.prompts_per_step=4",
            "rollout.group_size=2",
            "env.params.eval_size=20",
        ],
    )
    trained = rl_train(source)
    client().set_registered_model_alias("inference-src", "champion", trained.model_uri[-1])

    config = InferenceJobConfig(
        name="inference-job",
        model="models:/inference-src@champion",
        env=source.env,
        num_prompts=12,
        samples_per_prompt=2,
    )
    result = batch_inference(config)

    assert result.trajectories_uri.endswith("jobs/inference-job/inference/trajectories.jsonl")
    storage = Storage(get_settings().storage_root)
    lines = storage.read_bytes("jobs/inference-job/inference/trajectories.jsonl").splitlines()
    episodes = [json.loads(line) for line in lines]
    assert len(episodes) == result.num_episodes == 24
    assert {e["group_id"] for e in episodes} == set(range(12))
    for e in episodes:
        roles = [m["role"] for m in e["messages"]]
        assert "user" in roles and roles[-1] == "assistant"  # the env asked, the policy answered
        assert e["sampled_tokens"] > 0
    assert result.accuracy == pytest.approx(sum(e["correct"] for e in episodes) / 24)
    greedy_pairs = [episodes[k : k + 2] for k in range(0, 24, 2)]
    assert all(a["messages"] == b["messages"] for a, b in greedy_pairs)  # greedy: same answer

    run = client().get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["inference/accuracy"] == pytest.approx(result.accuracy)
    assert run.data.tags["flowrl.inference.trajectories"] == result.trajectories_uri
    assert storage.read_json("jobs/inference-job/result.json")["num_episodes"] == 24
