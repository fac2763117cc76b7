"""GPU verification of the backends that cannot run on the CPU machines: vLLM sampling and weight
sync (full and LoRA), a DeepSpeed ZeRO step on NCCL, and a short RL run with both selected by
config. Everything on a tiny random model built offline (no hub access needed).

    python benchmarks/gpu_check.py            # on a machine with a GPU, vllm and deepspeed

Each check prints PASS/FAIL with its numbers; the exit code is the number of failures.
UNVERIFIED until first run on a GPU: the CPU machines this was written on cannot import vLLM.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from flowrl.backends.chat import HFChatFormat  # noqa: E402
from flowrl.backends.models import TinyModelSpec, build_tiny_model, load_tokenizer  # noqa: E402
from flowrl.backends.types import Datum, LoraSettings, WorkerSpec  # noqa: E402

TOL = 2e-2  # bf16/fp16 kernels in vLLM vs fp32 in the trainer


def _spec(model_dir: str, work: str, lora: bool) -> WorkerSpec:
    return WorkerSpec(
        model_uri=model_dir,
        cache_dir=f"{work}/cache",
        lora=LoraSettings(enabled=lora, r=8, alpha=16),
        learning_rate=1e-3,
        device="cuda",
    )


def _prompts(model_dir: str) -> list[list[int]]:
    chat = HFChatFormat(load_tokenizer(model_dir))
    return [chat.encode_prompt([{"role": "user", "content": q}]) for q in ("1+1=", "12+7=", "Hi")]


def _max_logprob_gap(sampler, trainer, prompts: list[list[int]]) -> float:
    """Sample, then recompute the sampled tokens' log-probs in the trainer: largest |diff|."""
    results = sampler.sample(prompts, max_new_tokens=8, temperature=1.0, seed=0)
    data = [
        Datum(p + r.tokens, [0] * len(p) + [1] * len(r.tokens))
        for p, r in zip(prompts, results, strict=True)
    ]
    recomputed = trainer.compute_logprobs(data, temperature=1.0)
    return max(
        abs(a - b)
        for p, r, row in zip(prompts, results, recomputed, strict=True)
        for a, b in zip(r.logprobs, row[len(p) :], strict=True)
    )


def check_vllm_sync(model_dir: str, work: str, lora: bool) -> str:
    from flowrl.backends.deepspeed_trainer import DeepSpeedTrainer
    from flowrl.backends.hf_workers import TorchTrainer
    from flowrl.backends.vllm_sampler import VLLMSampler

    spec = _spec(model_dir, work, lora)
    sampler = VLLMSampler(spec, gpu_memory_utilization=0.3)
    trainer = (TorchTrainer if lora else DeepSpeedTrainer)(spec)
    prompts = _prompts(model_dir)
    start = time.perf_counter()
    results = sampler.sample(prompts * 32, max_new_tokens=16, temperature=1.0, seed=0)
    tok_s = sum(len(r.tokens) for r in results) / (time.perf_counter() - start)
    sampler.set_weights(trainer.get_weights())
    gap0 = _max_logprob_gap(sampler, trainer, prompts)
    for _ in range(3):  # move the weights, sync, compare again
        data = [
            Datum(p + [5, 6, 7], [0] * len(p) + [1, 1, 1], 1.0, [0.0] * (len(p) + 3))
            for p in prompts
        ]
        trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step()
    version = sampler.set_weights(trainer.get_weights())
    gap1 = _max_logprob_gap(sampler, trainer, prompts)
    assert version == 3 and gap0 < TOL and gap1 < TOL, (version, gap0, gap1)
    return f"{tok_s:.0f} tok/s; |logp gap| {gap0:.1e} before and {gap1:.1e} after 3 updates"


def check_deepspeed_step(model_dir: str, work: str, zero3: bool) -> str:
    from flowrl.backends.deepspeed_trainer import DeepSpeedTrainer, DeepSpeedZero3Trainer

    trainer = (DeepSpeedZero3Trainer if zero3 else DeepSpeedTrainer)(_spec(model_dir, work, False))
    data = [Datum([3, 5, 9, 14, 7, 3], [0, 1, 1, 1, 1, 1])]
    losses = []
    for _ in range(10):
        losses.append(trainer.forward_backward(data, "cross_entropy")["loss"])
        trainer.optim_step()
    assert losses[-1] < losses[0], losses
    return f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in 10 steps"


def check_rl_run(model_dir: str, work: str) -> str:
    from flowrl.backends.actors import start_policy, stop_policy
    from flowrl.tasks.jobs import RLJobConfig
    from flowrl.tasks.rl import rollout, score, update
    from flowrl.tasks.types import JobContext

    cfg = RLJobConfig.model_validate(
        {
            "name": "gpu-check",
            "model": {"source": model_dir},
            "warmup": {"enabled": False},
            "rollout": {"prompts_per_step": 8, "group_size": 4},
            "resources": {"sampler_backend": "vllm", "trainer_backend": "deepspeed"},
        }
    )
    ctx = JobContext(cfg.name, f"{work}/store", f"{work}/cache", cfg.name)
    policy = start_policy(
        cfg.name,
        _spec(model_dir, work, False),
        sampler_backend=cfg.resources.sampler_backend,
        trainer_backend=cfg.resources.trainer_backend,
        local=True,
    )
    try:
        cursor, start = None, time.perf_counter()
        for step in range(5):
            batch = rollout.fn(cfg, ctx, model_dir, policy, step, cursor)
            stats = update.fn(cfg, ctx, policy, score.fn(cfg, ctx, batch)).metrics
            cursor = batch.cursor
        assert stats["train/weights_version"] == 5, stats
    finally:
        stop_policy(policy)
    return f"5 RL steps (vllm sampler + deepspeed trainer) in {time.perf_counter() - start:.1f} s"


def main() -> int:
    if not torch.cuda.is_available():
        print("no GPU visible: nothing to check")
        return 1
    work = tempfile.mkdtemp(prefix="flowrl-gpu-check-")
    model_dir = build_tiny_model(TinyModelSpec(), f"{work}/tiny")
    checks: dict[str, Callable[[], str]] = {
        "vllm sample + full weight sync (deepspeed trainer)": lambda: check_vllm_sync(
            model_dir, work, lora=False
        ),
        "vllm sample + LoRA adapter hot-load": lambda: check_vllm_sync(model_dir, work, lora=True),
        "deepspeed ZeRO-2 step (nccl)": lambda: check_deepspeed_step(model_dir, work, False),
        "deepspeed ZeRO-3 step (nccl)": lambda: check_deepspeed_step(model_dir, work, True),
        "short RL run, backends by config": lambda: check_rl_run(model_dir, work),
    }
    failures = 0
    for name, check in checks.items():
        try:
            print(f"PASS {name}: {check()}", flush=True)
        except Exception:  # noqa: BLE001 - report every check, then exit non-zero
            failures += 1
            print(f"FAIL {name}:\n{traceback.format_exc()}", flush=True)
    print(f"{len(checks) - failures}/{len(checks)} checks passed on {torch.cuda.get_device_name()}")
    return failures


if __name__ == "__main__":
    sys.exit(main())
