"""Batch inference with a registered model through the training environment and agent loop:
episodes land as JSONL under the job's storage prefix, their scores in MLflow."""

from __future__ import annotations

import json
import os

import pytest

from flowrl.tasks.schemas import load_job

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def trained(prefect_api, flowrl_home):
    """A tiny RL-trained model registered as ``inference-src@champion``; its env section."""
    from flowrl.flows.rl import rl_train
    from flowrl.infra.tracking import client

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
    result = rl_train(source)
    client().set_registered_model_alias("inference-src", "champion", result.model_uri[-1])
    return source


def test_batch_inference_writes_scored_episodes_and_metrics(trained):
    from flowrl.flows.inference import batch_inference
    from flowrl.infra.settings import get_settings
    from flowrl.infra.storage import Storage
    from flowrl.infra.tracking import client
    from flowrl.tasks.schemas import InferenceJobConfig

    source = trained
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
    assert storage.read_json("jobs/inference-job/job.json")["mlflow_run_id"] == run.info.run_id


def test_batch_inference_on_the_environment_service_matches_local(trained, monkeypatch):
    """``env.mode: http`` (the real service on loopback, with a token) plays the same episodes
    as ``local``, on the service: the same JSONL, the same scores."""
    import httpx
    from services import start_env_service

    from flowrl.environments.remote import KEY_VAR
    from flowrl.flows.inference import batch_inference
    from flowrl.infra.settings import get_settings
    from flowrl.infra.storage import Storage
    from flowrl.tasks.schemas import InferenceJobConfig

    token = "inference-token-0123456789abcdef"
    service_env = dict(os.environ, FLOWRL_ENV_SERVICE_KEYS=f"tester:{token}")
    url, proc = start_env_service(env=service_env, options=())
    monkeypatch.setenv(KEY_VAR, token)
    storage = Storage(get_settings().storage_root)
    episodes = {}
    try:
        for mode in ("local", "http"):
            where = {"mode": mode} | ({"service_url": url} if mode == "http" else {})
            env = trained.env.model_copy(update=where)
            config = InferenceJobConfig.model_validate(
                {
                    "name": f"inference-{mode}",
                    "model": "models:/inference-src@champion",
                    "env": env.model_dump(),
                    "num_prompts": 6,
                    "samples_per_prompt": 2,
                }
            )
            result = batch_inference(config)
            lines = storage.read_bytes(f"jobs/inference-{mode}/inference/trajectories.jsonl")
            episodes[mode] = [json.loads(line) for line in lines.splitlines()]
            assert storage.read_json(f"jobs/inference-{mode}/result.json")["num_episodes"] == 12
            assert storage.exists(f"jobs/inference-{mode}/job.json")
            assert result.num_episodes == 12
        headers = {"Authorization": f"Bearer {token}"}
        stats = httpx.get(f"{url}/stats", headers=headers).json()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert not any(e["failed"] for e in episodes["http"])
    assert episodes["http"] == episodes["local"]
    assert stats["steps"] >= 12  # the http job's episodes were played on the service
