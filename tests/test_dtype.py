"""Precision (``resources.dtype``): bf16 workers on CPU end to end, the mismatch KL, the config
field, and the self-contained GPU check at its tiny size.

bf16 tolerance: bf16 keeps 8 significand bits (relative step 2^-8 = 3.9e-3), and the bf16
sampler and the trainer (float32 master weights, bf16 autocast forward) round differently
along the way; on the tiny model their log-probs differed by at most 4e-3 when measured, so
``BF16_LOGPROB_ATOL = 5e-2`` leaves a 10x margin, and the mismatch KL must stay under 1e-3
(issue 16's bar on a GPU). float32 must agree to 1e-5, as in ``test_workers.py``.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest
import torch

from flowrl.agent_loop.types import SampleResult
from flowrl.backends.engines.algorithms import mismatch_kl
from flowrl.backends.engines.hf_sampler import HFSampler
from flowrl.backends.engines.torch_trainer import TorchTrainer
from flowrl.backends.models.cpu_kernels import pick_cpu_dtype
from flowrl.backends.models.precision import compute_dtype
from flowrl.backends.policy import actors
from flowrl.backends.types import Datum, LoraSettings, WorkerSpec
from flowrl.tasks.schemas import RLJobConfig

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
BF16_LOGPROB_ATOL = 5e-2
FP32_LOGPROB_ATOL = 1e-5
MISMATCH_KL_BOUND = {"bfloat16": 1e-3, "float32": 1e-9}


def as_data(prompts: list[list[int]], results: list[SampleResult]) -> list[Datum]:
    """Prompt + completion; loss and the sampler's log-probs on the completion only."""
    return [
        Datum(p + r.tokens, [0] * len(p) + [1] * len(r.tokens), 1.0, [0.0] * len(p) + r.logprobs)
        for p, r in zip(prompts, results, strict=True)
    ]


def logprob_gap(sampler: HFSampler, trainer: TorchTrainer, prompts: list[list[int]]) -> float:
    """Sample, recompute in the trainer: the largest |sampler - trainer| log-prob."""
    results = sampler.sample(prompts, 12, 1.0, seed=5)
    rows = trainer.compute_logprobs(as_data(prompts, results))
    return max(
        abs(a - b)
        for p, r, row in zip(prompts, results, rows, strict=True)
        for a, b in zip(r.logprobs, row[len(p) :], strict=True)
    )


def test_mismatch_kl_matches_hand_computed_values():
    sampler_B_T = torch.tensor([[-1.0, -2.0, -0.5]])
    trainer_B_T = torch.tensor([[-1.1, -1.8, -3.0]])
    mask_B_T = torch.tensor([[1.0, 1.0, 0.0]])
    # d = trainer - sampler: -0.1 -> e^-0.1 + 0.1 - 1 = 0.0048374180; 0.2 -> e^0.2 - 1.2 =
    # 0.0214027582; the third token is masked out. Mean: 0.0131200881.
    kl = mismatch_kl(trainer_B_T, sampler_B_T, mask_B_T)
    assert float(kl) == pytest.approx(0.0131200881, abs=1e-7)
    assert float(mismatch_kl(sampler_B_T, sampler_B_T, mask_B_T)) == 0.0


def test_auto_is_bf16_on_cuda_and_on_cpus_with_bf16_dot_products_for_large_models():
    """A worker's auto is bf16 on CUDA, float32 on a CPU; a CPU job's auto (decided in its
    flow) is bf16 for a model of 50M parameters or more where the CPU's kernels in force have
    bf16 dot products (AVX512-BF16, AMX), and float32 where the kernels are capped below them
    (as this suite pins them), on other CPUs, and for smaller models, so a job's precision
    never depends on an emulated bf16."""
    assert compute_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert compute_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    flags = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if "flags" in line]
    has_dots = any(f in flags[0].split() for f in ("avx512_bf16", "amx_bf16"))
    probe = "from flowrl.backends.models.cpu_kernels import cpu_bf16; print(*cpu_bf16(), sep='|')"

    def decided(**env: str) -> list[str]:
        pins = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_CBWR")
        clean = {k: v for k, v in os.environ.items() if k not in pins} | env
        out = subprocess.run([sys.executable, "-c", probe], env=clean, capture_output=True)
        return out.stdout.decode().strip().split("|")

    capped = decided(ATEN_CPU_CAPABILITY="avx2", ONEDNN_MAX_CPU_ISA="AVX2")
    assert capped[0] == "False" and capped[1].endswith(": float32"), capped
    own = decided()
    assert own[0] == str(has_dots) and own[1], own

    fast = (True, "the CPU has avx512_bf16: bf16 matmuls run 2-3x float32s")
    assert pick_cpu_dtype(99_190_000, fast) == (
        "bfloat16",
        f"{fast[1]}; the model has 99M parameters",
    )
    small = pick_cpu_dtype(3_190_000, fast)
    assert small[0] == "float32" and "3.19M parameters, under 50M" in small[1], small
    assert pick_cpu_dtype(None, fast)[0] == "float32"
    assert pick_cpu_dtype(99_190_000, (False, "capped: float32")) == ("float32", "capped: float32")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_workers_sample_sync_and_update_in_each_precision(
    model_dir, prompts, tmp_path, dtype, lora
):
    spec = WorkerSpec(
        model_uri=model_dir,
        cache_dir=str(tmp_path),
        device="cpu",
        dtype=dtype,
        lora=LoraSettings(enabled=lora, r=4, alpha=8),
    )
    sampler, trainer = HFSampler(spec), TorchTrainer(spec)
    assert sampler.model.dtype == getattr(torch, dtype)
    # fp32 master weights whatever the compute dtype
    assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
    before = {k: v.clone() for k, v in trainer.get_weights()[0].items()}

    data = as_data(prompts, sampler.sample(prompts, 12, 1.0, seed=0))
    metrics = trainer.forward_backward(data, "ppo_clip") | trainer.optim_step()
    assert 0.0 <= metrics["mismatch_kl"] < MISMATCH_KL_BOUND[dtype]
    weights, version = trainer.get_weights()
    assert version == 1 and any(not torch.equal(before[k], w) for k, w in weights.items())
    assert {w.dtype for w in weights.values()} == {torch.float32}

    assert sampler.set_weights((weights, version)) == 1
    if not lora:  # the sampler holds the trainer's weights rounded to its dtype
        name = "model.layers.0.self_attn.q_proj.weight"
        synced = sampler.model.state_dict()[name]
        assert torch.equal(synced, weights[name].to(synced.dtype))
    gap = logprob_gap(sampler, trainer, prompts)
    if dtype == "bfloat16":
        assert 0.0 < gap < BF16_LOGPROB_ATOL  # > 0: the sampler did compute in bf16
    else:
        assert gap < FP32_LOGPROB_ATOL
    # after the sync, the trainer's logged mismatch on fresh samples stays small
    data = as_data(prompts, sampler.sample(prompts, 12, 1.0, seed=6))
    assert trainer.forward_backward(data, "ppo_clip")["mismatch_kl"] < MISMATCH_KL_BOUND[dtype]


@pytest.mark.parametrize("dtype,kernels", [("bfloat16", "eager"), ("float32", "sdpa")])
def test_cpu_workers_in_bf16_run_eager_attention(model_dir, tmp_path, dtype, kernels):
    """torch's fused CPU attention is slow in bf16 (docs/benchmarks/cpu_attention.md): a CPU
    worker computing in bf16 runs eager attention, sampler and trainer (its sampler copy too);
    in float32 transformers' default stays."""
    spec = WorkerSpec(model_uri=model_dir, cache_dir=str(tmp_path), device="cpu", dtype=dtype)
    trainer = TorchTrainer(spec)
    sampler = HFSampler.following(spec, trainer) or HFSampler(spec)
    for model in (trainer.model, sampler.model, HFSampler(spec).model):
        assert model.config._attn_implementation == kernels


def test_truncated_is_weights_the_bf16_samplers_tokens_by_the_trainers_own_logprobs(
    model_dir, prompts, tmp_path
):
    """With ``tis_cap`` the ratio is against the trainer's own log-probs (so 1 before the step)
    and each token weighs ``w = min(p_trainer / p_sampler, cap)``: with every advantage 1 the
    PPO-clip loss is ``-mean(w)``, which the trainer's recomputed log-probs give by hand."""
    spec = WorkerSpec(model_uri=model_dir, cache_dir=str(tmp_path), device="cpu")
    sampler = HFSampler(spec.model_copy(update={"dtype": "bfloat16"}))
    trainer = TorchTrainer(spec)  # float32: a precision mismatch, as with a bf16 engine
    data = as_data(prompts, sampler.sample(prompts, 12, 1.0, seed=0))
    expected_w = [
        min(math.exp(t - s), 1.002)
        for d, row in zip(data, trainer.compute_logprobs(data), strict=True)
        for t, s, m in zip(row, d.old_logprobs, d.loss_mask, strict=True)
        if m
    ]
    metrics = trainer.forward_backward(data, "ppo_clip", {"tis_cap": 1.002})
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_fraction"] == 0.0
    assert metrics["tis_weight_mean"] == pytest.approx(statistics.mean(expected_w), abs=1e-5)
    assert metrics["loss"] == pytest.approx(-metrics["tis_weight_mean"], abs=1e-6)
    capped = sum(w == 1.002 for w in expected_w) / len(expected_w)
    assert 0.0 < metrics["tis_clip_frac"] == pytest.approx(capped, abs=0.05)
    assert metrics["tis_weight_mean"] != 1.0  # the weights did correct something
    assert "tis_weight_mean" not in trainer.forward_backward(data, "ppo_clip")  # off by default


def test_no_mismatch_kl_without_the_samplers_logprobs(model_dir, prompts, tmp_path):
    trainer = TorchTrainer(WorkerSpec(model_uri=model_dir, cache_dir=str(tmp_path)))
    data = [Datum(p + [10, 11], [0] * len(p) + [1, 1]) for p in prompts]  # SFT rows
    assert "mismatch_kl" not in trainer.forward_backward(data, "cross_entropy")


def test_dtype_is_validated_and_reaches_the_worker_spec(monkeypatch):
    with pytest.raises(pydantic.ValidationError) as err:
        RLJobConfig.model_validate({"resources": {"dtype": "float16"}})
    assert "resources.dtype" in str(err.value)

    started: list[WorkerSpec] = []

    def record(cls, name, paths, specs, *args):
        started.append(specs["sampler"])

    for kind in (actors.SplitPolicy, actors.ColocatedPolicy):  # own workers, either way
        monkeypatch.setattr(kind, "start", classmethod(record))
    cfg = RLJobConfig.model_validate({"resources": {"dtype": "bfloat16"}})
    assert RLJobConfig().resources.dtype == "auto"
    cfg.resources.placement_for().start_policy("job", WorkerSpec(model_uri="m", cache_dir="c"))
    assert started[0].dtype == "bfloat16"


def _table_rows(text: str, title: str) -> dict[tuple[str, str], list[str]]:
    """Rows of the markdown table under ``## title``, keyed by (mode, precision)."""
    section = text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]
    cells = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("| ") and not line.startswith("| mode")
    ]
    return {(c[0], c[1]): c[2:] for c in cells}


def test_gpu_check_runs_on_cpu_at_the_tiny_size_without_orchestration(tmp_path):
    out = tmp_path / "gpu.md"
    # prefect, ray and mlflow absent (None in sys.modules), as on the GPU machine
    wrapper = (
        "import runpy, sys\n"
        "for name in ('prefect', 'ray', 'mlflow'):\n"
        "    sys.modules[name] = None\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    script = REPO / "benchmarks" / "gpu_check.py"
    args = ["--device", "cpu", "--size", "tiny", "--threads", "1", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-c", wrapper, str(script), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DeepSpeed ZeRO-2 on one GPU: skipped: DeepSpeed ZeRO-2 with NCCL needs CUDA" in (
        proc.stdout
    )
    text = out.read_text()
    configs = {(m, d) for m in ("full", "lora") for d in ("bfloat16", "float32")}
    sampling = _table_rows(text, "Sampling")
    training = _table_rows(text, "Training")
    agreement = _table_rows(text, "Sampler vs trainer")
    assert set(sampling) == set(training) == set(agreement) == configs
    assert all(float(row[0]) > 0 for row in (*sampling.values(), *training.values()))
    for (_, dtype), (max_diff, kl, step_kl, _, meets) in agreement.items():
        assert meets == "yes"
        if dtype == "float32":
            assert float(max_diff) < FP32_LOGPROB_ATOL and float(kl) < 1e-9
        else:
            assert float(max_diff) < BF16_LOGPROB_ATOL and float(step_kl) < 1e-3
    assert "vLLM" in text and "skipped: the vLLM sampler needs CUDA" in text


@pytest.mark.parametrize(
    ("correction", "weigh"),
    [
        ({"name": "mis", "band": [0.998, 1.002]}, lambda r: r if 0.998 <= r <= 1.002 else 0.0),
        ({"name": "decoupled", "cap": 1.002}, lambda r: r if r <= 1.002 else 0.0),
    ],
)
def test_masked_and_decoupled_corrections_weigh_the_bf16_samplers_tokens(
    model_dir, prompts, tmp_path, correction, weigh
):
    """``is_correction`` (issue 43) in the trainer: the ratio against the trainer's own
    log-probs, each token weighed by its correction's weight of ``p_trainer / p_sampler``; with
    every advantage 1 the loss is minus the mean weight, the tokens out of band or over the
    cap dropped as the trainer's recomputed log-probs say."""
    spec = WorkerSpec(model_uri=model_dir, cache_dir=str(tmp_path), device="cpu")
    sampler = HFSampler(spec.model_copy(update={"dtype": "bfloat16"}))
    trainer = TorchTrainer(spec)
    data = as_data(prompts, sampler.sample(prompts, 12, 1.0, seed=0))
    expected_w = [
        weigh(math.exp(t - s))
        for d, row in zip(data, trainer.compute_logprobs(data), strict=True)
        for t, s, m in zip(row, d.old_logprobs, d.loss_mask, strict=True)
        if m
    ]
    metrics = trainer.forward_backward(data, "ppo_clip", {"is_correction": correction})
    name = correction["name"]
    assert metrics["ratio_mean"] == 1.0 and metrics["clip_fraction"] == 0.0
    assert metrics["loss"] == pytest.approx(-metrics[f"{name}_weight_mean"], abs=1e-6)
    assert metrics[f"{name}_weight_mean"] == pytest.approx(statistics.mean(expected_w), abs=0.02)
    dropped = sum(w == 0.0 for w in expected_w) / len(expected_w)
    assert 0.0 < metrics[f"{name}_masked_frac"] == pytest.approx(dropped, abs=0.05)
    assert metrics["is_ratio_min"] <= 1.0 <= metrics["is_ratio_max"]
