"""The vLLM sampler (``resources.sampler_backend: vllm``) on this machine's CPU, in the venv
``make setup-vllm`` builds: one policy of the tiny model (a vLLM sampler actor and a torch
trainer) is shared by the module, since an engine takes seconds to start. Weight sync each
step, full and LoRA: after a sync the engine's greedy tokens are the trainer's; its log-probs
agree with the trainer's recomputation; a bad prompt fails its call and the engine serves on.

Without the vLLM venv the module skips, saying what to install, except under CI, where
``make test`` installs it and a missing engine is a failure."""

from __future__ import annotations

import itertools
import os

import pytest

from flowrl.backends.policy.actors import sampler, start_policy, stop_policy, sync_weights, trainer
from flowrl.backends.policy.resources import SAMPLER_BACKENDS
from flowrl.backends.policy.workers import backend_runtime_env
from flowrl.backends.types import Datum, LoraSettings, WorkerSpec
from flowrl.infra.settings import get_settings

_names = itertools.count()


def _vllm_venv_or_skip() -> None:
    python = get_settings().resolved_vllm_python
    if python.exists():
        return
    message = f"no vLLM venv at {python} (make setup-vllm)"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="module")
def policy_of(model_dir: str, tmp_path_factory: pytest.TempPathFactory, ray_local: None):
    """``policy_of(lora)``: a vLLM sampler and a torch trainer of the tiny model, started once
    per module and LoRA setting."""
    _vllm_venv_or_skip()
    refs: dict[bool, object] = {}
    cache = str(tmp_path_factory.mktemp("vllm-cache"))

    def _policy(lora: bool):
        if lora not in refs:
            spec = WorkerSpec(
                model_uri=model_dir,
                cache_dir=cache,
                seed=0,
                learning_rate=1e-2,
                lora=LoraSettings(enabled=lora, r=8, alpha=16),
            )
            name = f"test-vllm-{next(_names)}"
            refs[lora] = (start_policy(name, spec, sampler_backend="vllm"), spec)
        return refs[lora]

    yield _policy
    for ref, _ in refs.values():
        stop_policy(ref)


def _data(prompts: list[list[int]], results, advantages: list[float]) -> list[Datum]:
    return [
        Datum(p + r.tokens, [0] * len(p) + [1] * len(r.tokens), a, [0.0] * len(p) + r.logprobs)
        for p, r, a in zip(prompts, results, advantages, strict=True)
    ]


def _trainer_greedy(ref, spec: WorkerSpec, prompts: list[list[int]], length: int):
    """The trainer's greedy tokens: its weights in an ``HFSampler`` of this process."""
    from flowrl.backends.engines.hf_sampler import HFSampler

    local = HFSampler(spec)
    local.set_weights(trainer(ref).get_weights())
    return [r.tokens for r in local.sample(prompts, length, 0.0)]


def _prompts16(prompts: list[list[int]]) -> list[list[int]]:
    return [p + [5 + i] for i in range(6) for p in prompts][:16]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_after_each_sync_the_engine_samples_what_the_trainer_holds(policy_of, prompts, lora):
    """Three updates, each followed by a sync without restarting the engine: after each, the
    engine's greedy tokens of 16 prompts are the trainer's, and the log-probs vLLM reports
    for them are the trainer's recomputation (fp32, within 1e-3); the greedy tokens moved
    away from the pre-update ones (the weights really changed in the engine)."""
    ref, spec = policy_of(lora)
    batch = _prompts16(prompts)
    before = [r.tokens for r in sampler(ref).sample(batch, 8, 0.0)]
    moved = False
    for step in range(3):
        results = sampler(ref).sample(batch, 8, 1.0, seed=step)
        advantages = [1.0 if i % 2 else -1.0 for i in range(len(batch))]
        trainer(ref).forward_backward(_data(batch, results, advantages), "ppo_clip")
        trainer(ref).optim_step()
        assert sync_weights(ref) == step + 1
        greedy = sampler(ref).sample(batch, 8, 0.0)
        assert [r.tokens for r in greedy] == _trainer_greedy(ref, spec, batch, 8)
        rows = trainer(ref).compute_logprobs(_data(batch, greedy, [0.0] * len(batch)), 1.0)
        for p, r, row in zip(batch, greedy, rows, strict=True):
            assert row[len(p) :] == pytest.approx(r.logprobs, abs=1e-3)
        moved = moved or [r.tokens for r in greedy] != before
    assert moved


def test_a_bad_prompt_fails_its_call_and_the_engine_serves_on(policy_of, prompts):
    ref, _ = policy_of(False)
    with pytest.raises(Exception, match="outside the vocabulary"):
        sampler(ref).sample([prompts[0] + [10**6]], 4, 1.0)
    with pytest.raises(Exception, match="no room to sample"):
        sampler(ref).sample([prompts[0] * 400], 4, 1.0)
    assert len(sampler(ref).sample(prompts, 4, 1.0, seed=1)) == len(prompts)


def test_seeded_calls_sample_the_same_tokens(policy_of, prompts):
    ref, _ = policy_of(False)
    first = sampler(ref).sample(prompts, 8, 1.0, seed=11)
    again = sampler(ref).sample(prompts, 8, 1.0, seed=11)
    other = sampler(ref).sample(prompts, 8, 1.0, seed=12)
    assert [r.tokens for r in first] == [r.tokens for r in again]
    assert [r.tokens for r in first] != [r.tokens for r in other]


def test_a_missing_vllm_venv_is_named_before_anything_starts(monkeypatch, tmp_path):
    monkeypatch.setenv("FLOWRL_VLLM_PYTHON", str(tmp_path / "none" / "bin" / "python"))
    monkeypatch.delenv("FLOWRL_RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="make setup-vllm"):
        backend_runtime_env(SAMPLER_BACKENDS["vllm"])


# ------------------------------------------------------------ jobs with the vLLM sampler

STEPS = 80


@pytest.fixture(scope="module")
def trained_on_vllm(prefect_api, flowrl_home):
    """The e2e learning test's job (tests/test_flow_e2e.py) with its rollouts and
    evaluations sampled by vLLM."""
    _vllm_venv_or_skip()
    from flowrl.flows.rl import rl_train
    from flowrl.tasks.schemas import load_job

    config = load_job(
        None,
        [
            "name=arithmetic-vllm",
            f"schedule.steps={STEPS}",
            "schedule.eval_every=40",
            "schedule.checkpoint_every=40",
            "rollout.prompts_per_step=32",
            "resources.sampler_backend=vllm",
        ],
    )
    return config, rl_train(config)


def _history(run_id: str, metric: str) -> list[float]:
    from flowrl.infra.tracking import client

    points = sorted(client().get_metric_history(run_id, metric), key=lambda m: m.step)
    return [m.value for m in points]


def test_an_rl_job_sampled_by_vllm_learns(trained_on_vllm):
    """Reward rises by the e2e test's bar; the trainer's recomputed log-probs of what vLLM
    sampled differ from vLLM's by a mismatch-KL under 1e-3 a token (fp32, on-policy)."""
    import statistics

    _, result = trained_on_vllm
    rewards = _history(result.mlflow_run_id, "reward/mean")
    assert len(rewards) == STEPS
    first, last = statistics.mean(rewards[:20]), statistics.mean(rewards[-20:])
    mismatch = _history(result.mlflow_run_id, "train/mismatch_kl")
    print(
        f"\nvLLM: reward/mean first 20 {first:.3f}, last 20 {last:.3f}; mismatch-KL max "
        f"{max(mismatch):.2e}, mean {statistics.mean(mismatch):.2e}"
    )
    assert last > first + 0.05, (first, last)
    assert result.accuracy_end > result.accuracy_start
    assert len(mismatch) == STEPS and max(mismatch) < 1e-3


def test_a_registered_version_runs_batch_inference_and_evaluation_on_vllm(
    trained_on_vllm, monkeypatch
):
    """The version the job registered, served by vLLM: batch inference writes its scored
    episodes (greedy: both samples of a prompt alike), and an evaluation's greedy accuracy is
    the job's own final held-out accuracy. The inference job leaves ``sampler_backend`` at its
    default, auto, with the size from which it picks vLLM lowered under the tiny model's: it
    picks vLLM, and its MLflow run says so and why."""
    from flowrl.flows.evaluate import evaluate
    from flowrl.flows.inference import batch_inference
    from flowrl.infra.tracking import client
    from flowrl.tasks.schemas import EvalJobConfig, InferenceJobConfig, load_job

    config, result = trained_on_vllm
    monkeypatch.setenv("FLOWRL_VLLM_AUTO_MIN_PARAMETERS", "100000")  # the tiny model: 0.34M
    monkeypatch.setenv("FLOWRL_VLLM_AUTO_ON_CPU", "1")  # this machine's workers have no GPU
    monkeypatch.setenv("FLOWRL_CPU_THREADS", "2")  # torch_threads auto: vLLM's OpenMP threads
    inference = batch_inference(
        InferenceJobConfig.model_validate(
            {
                "name": "inference-vllm",
                "model": result.model_uri,
                "env": config.env.model_dump(),
                "num_prompts": 12,
                "samples_per_prompt": 2,
            }
        )
    )
    assert inference.num_episodes == 24
    tags = client().get_run(inference.mlflow_run_id).data.tags
    assert tags["sampler_backend"] == "vllm", tags
    assert "0.34M parameters" in tags["sampler_backend.why"], tags
    assert tags["torch_threads"] == "sampler 2, trainer 2", tags
    assert "take turns on 2 cores" in tags["torch_threads.why"], tags
    assert tags["dtype"] == "float32" and tags["dtype.why"].endswith(": float32"), tags  # 0.34M
    evaluation = evaluate(
        load_job(
            None,
            [
                "name=eval-vllm",
                f"models=[{result.model_uri}]",
                "samples=2",
                "k=[1, 2]",
                "resources.sampler_backend=vllm",
            ],
            EvalJobConfig,
        )
    )
    (score,) = evaluation.scores[0]
    assert score.failed == 0
    assert score.greedy_accuracy == pytest.approx(result.accuracy_end)


# ------------------------------------------------------------ the Tinker API's sampling


def test_tinker_sdk_samples_saved_weights_on_vllm(ray_local, tmp_path, monkeypatch):
    """``flowrl serve tinker --sampler-engine vllm``'s service, through the Tinker SDK: a LoRA
    trained a few steps, saved with ``save_weights_for_sampler``, is sampled by the vLLM
    engine; its log-probs of the greedy answer are the trainer's (fp32, within 1e-3) and not
    the base model's; seeds repeat; a pathless snapshot is served as well; a prompt out of
    the vocabulary is a 400 and the engine samples on."""
    import numpy as np
    import tinker
    from services import TinkerServer
    from tinker import types

    from flowrl.backends.models.model_folder import load_tokenizer
    from flowrl.backends.models.tinker_checkpoints import resolve_base_model
    from flowrl.backends.policy.placement import InProcess, VLLMEngines
    from flowrl.backends.services.tinker.service import TinkerService

    _vllm_venv_or_skip()
    monkeypatch.setenv("FLOWRL_HOME", str(tmp_path))
    key = "tml-alice-" + "a" * 24
    service = TinkerService(InProcess(), keys={key: "alice"}, sampler_placement=VLLMEngines())
    server = TinkerServer(service)
    client = tinker.ServiceClient(base_url=server.url, api_key=key)
    try:
        tokenizer = load_tokenizer(resolve_base_model("tiny", str(tmp_path / "model-cache")))
        tc = client.create_lora_training_client("flowrl/tiny", rank=4, seed=2).result()
        lines = ["12+7=19", "3+4=7", "5+5=10", "21+13=34"]
        data = []
        for line in lines:
            ids = tokenizer.encode(line)
            data.append(
                types.Datum(
                    model_input=types.ModelInput.from_ints(ids[:-1]),
                    loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)},
                )
            )
        for _ in range(5):
            tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_weights_for_sampler("five").result().path
        sampler = client.create_sampling_client(model_path=path).result()
        base = client.create_sampling_client(base_model="flowrl/tiny").result()
        prompt = tokenizer.encode("12+7=")
        greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
        answer = sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy).result()
        tokens = answer.sequences[0].tokens
        scored = tc.forward(
            [
                types.Datum(
                    model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
                    loss_fn_inputs={"target_tokens": (prompt + tokens)[1:]},
                )
            ],
            "cross_entropy",
        ).result()
        trainer_lp = scored.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1 :]
        np.testing.assert_allclose(answer.sequences[0].logprobs, trainer_lp, atol=1e-3)
        from_base = base.sample(types.ModelInput.from_ints(prompt), 1, greedy).result()
        assert from_base.sequences[0].logprobs != answer.sequences[0].logprobs

        hot = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
        one = sampler.sample(types.ModelInput.from_ints(prompt), 4, hot).result()
        again = sampler.sample(types.ModelInput.from_ints(prompt), 4, hot).result()
        assert len(one.sequences) == 4
        assert [s.tokens for s in one.sequences] == [s.tokens for s in again.sequences]

        live = tc.save_weights_and_get_sampling_client().result()
        same = live.sample(types.ModelInput.from_ints(prompt), 1, greedy).result()
        assert same.sequences[0].tokens == tokens  # no step since the save: the same weights

        with pytest.raises(tinker.BadRequestError, match="outside the vocabulary"):
            sampler.sample(types.ModelInput.from_ints([10**6]), 1, greedy).result()
        after = sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy).result()
        assert after.sequences[0].tokens == tokens
    finally:
        client.close("success").result()
        server.stop()
