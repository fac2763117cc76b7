"""Self-contained check of the GPU path (issue 16): flowrl's sampler and trainer classes driven
directly, no Prefect, Ray or MLflow. Writes a markdown table.

    python benchmarks/gpu_check.py --device cuda --size qwen2-0.5b --out docs/benchmarks/gpu.md
    python benchmarks/gpu_check.py --device cpu --size tiny --threads 1 --out /tmp/gpu.md  # CI

The model is a random-weight Qwen2 built here: ``qwen2-0.5b`` has Qwen2-0.5B's shape (hidden
896, 24 layers, 14 heads, 2 KV heads, MLP 4864, vocabulary 151,936, tied embeddings), ``tiny``
is the family fixture's (hidden 64, 2 layers); the tokenizer is the ChatML family fixture's
(``tests/families.py``: a byte-level BPE trained offline). Measured, at group size 8 (one
prompt, eight samples at temperature 1):

- sampling tokens/s and time to first token (``HFSampler``), per precision and mode;
- training s/step and tokens/s (prompt + completion tokens through forward and backward, one
  ``ppo_clip`` step), full and LoRA x bfloat16 and float32 (``TorchTrainer``);
- sampler-vs-trainer log-probs after a weight sync: max |diff| and mismatch KL
  (``algorithms.mismatch_kl``), against issue 16's targets (KL < 1e-3 in bf16, < 1e-6 in fp32);
- peak GPU memory of sampler + trainer (CUDA only);
- DeepSpeed ZeRO-2 on one GPU with NCCL (CUDA only; skipped with the reason on CPU);
- the vLLM sampler, only where ``vllm`` imports (and CUDA is there).

Needs torch, transformers, peft, accelerate, safetensors, tokenizers, pydantic and pillow;
deepspeed and vllm only for their rows. It runs from a checkout without installing flowrl.
The exit code counts failed sections and missed KL targets. UNVERIFIED on a GPU: no GPU has
been lent to this project yet; only the CPU run at ``--size tiny`` has executed
(``tests/test_dtype.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import flowrl  # noqa: E402

if importlib.util.find_spec("flowrl.backends") is None:  # a checkout that is not installed
    flowrl.__path__.append(str(ROOT))  # flowrl.backends -> backends/, as the package maps it

import torch  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from flowrl.backends.engines.algorithms import mismatch_kl  # noqa: E402
from flowrl.backends.engines.hf_sampler import HFSampler  # noqa: E402
from flowrl.backends.engines.torch_trainer import TorchTrainer  # noqa: E402
from flowrl.backends.models.chat import HFChatFormat  # noqa: E402
from flowrl.backends.types import Datum, LoraSettings, WorkerSpec  # noqa: E402
from tests.families import FAMILIES, build_family  # noqa: E402

GROUP = 8
PRECISIONS = ("bfloat16", "float32")
MODES = ("full", "lora")
KL_TARGET = {"bfloat16": 1e-3, "float32": 1e-6}
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"shape": {}, "new_tokens": 16, "steps": 3, "question": "What is 12 * 34?"},
    "qwen2-0.5b": {
        "shape": {
            "hidden_size": 896,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "intermediate_size": 4864,
            "vocab_size": 151936,
            "max_position_embeddings": 32768,
            "rope_theta": 1_000_000.0,
        },
        "new_tokens": 256,
        "steps": 5,
        "question": "Think step by step, then use the calculator. " * 8 + "What is 12 * 34?",
    },
}


def build_model(size: str, out_dir: str, device: torch.device) -> str:
    """The ChatML family fixture (tokenizer, template, eos ids); for ``qwen2-0.5b`` its model
    is replaced by a random-weight Qwen2 of Qwen2-0.5B's shape (seed 0)."""
    build_family(FAMILIES["chatml"], out_dir)
    shape = SIZES[size]["shape"]
    if shape:
        fixture = Qwen2Config.from_pretrained(out_dir).to_dict()
        ids = ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings")
        config = Qwen2Config(**{k: fixture[k] for k in ids}, **shape)
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(0)
            model = Qwen2ForCausalLM(config)
        model.save_pretrained(out_dir)
        del model
    return out_dir


@dataclass(frozen=True)
class Setup:
    """What every measurement shares: the arguments, the model folder, the group's prompts."""

    args: argparse.Namespace
    model_dir: str
    work: str
    prompts: list[list[int]]

    @property
    def device(self) -> torch.device:
        return torch.device(self.args.device)

    @property
    def new_tokens(self) -> int:
        return SIZES[self.args.size]["new_tokens"]

    @property
    def steps(self) -> int:
        return SIZES[self.args.size]["steps"]

    def spec(self, mode: str, dtype: str) -> WorkerSpec:
        return WorkerSpec(
            model_uri=self.model_dir,
            cache_dir=f"{self.work}/cache",
            lora=LoraSettings(enabled=mode == "lora", r=16, alpha=32),
            learning_rate=1e-5,
            torch_threads=self.args.threads,
            device=self.args.device,
            dtype=dtype,
        )


def as_data(prompts: list[list[int]], results: list[Any]) -> list[Datum]:
    """Prompt + completion per row, loss on the completion, advantages +1/-1 alternating."""
    return [
        Datum(
            p + r.tokens,
            [0] * len(p) + [1] * len(r.tokens),
            (-1.0) ** i,
            [0.0] * len(p) + r.logprobs,
        )
        for i, (p, r) in enumerate(zip(prompts, results, strict=True))
    ]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - start


def measure_sampling(
    sampler: Any, prompts: list[list[int]], new_tokens: int, device: torch.device
) -> dict[str, float]:
    """Time to first token (best of 3, ``max_new_tokens=1``) and tokens/s of a whole group."""
    sampler.sample(prompts, 2, 1.0, seed=0)  # warm-up: kernels, caches
    ttft = min(timed(lambda: sampler.sample(prompts, 1, 1.0, seed=0), device)[1] for _ in range(3))
    results, seconds = timed(lambda: sampler.sample(prompts, new_tokens, 1.0, seed=1), device)
    tokens = sum(len(r.tokens) for r in results)
    return {"sample_tok_s": tokens / seconds, "ttft": ttft, "tokens": tokens}


def measure_training(trainer: Any, data: list[Datum], steps: int) -> dict[str, float]:
    """s/step (mean after one warm-up step) and tokens/s of ``ppo_clip`` steps on ``data``;
    ``step_mismatch_kl``: the first step's ``mismatch_kl`` (same weights as the sampler's)."""
    tokens = sum(len(d.tokens) for d in data)
    seconds: list[float] = []
    first: dict[str, float] = {}
    for _ in range(steps + 1):
        (metrics, _), step_s = timed(
            lambda: (trainer.forward_backward(data, "ppo_clip"), trainer.optim_step()),
            trainer.device,
        )
        seconds.append(step_s)
        first = first or metrics
    s_step = sum(seconds[1:]) / steps
    return {
        "s_step": s_step,
        "train_tok_s": tokens / s_step,
        "step_mismatch_kl": first["mismatch_kl"],
    }


def measure_agreement(
    sampler: Any, trainer: Any, prompts: list[list[int]], new_tokens: int
) -> dict[str, float]:
    """Weight sync, then sample and recompute: max |logp diff|, mismatch KL and the sync's
    seconds (the trainer's weights out, loaded in place by the sampler)."""
    start = time.perf_counter()
    sampler.set_weights(trainer.get_weights())
    sync_s = time.perf_counter() - start
    results = sampler.sample(prompts, new_tokens, 1.0, seed=2)
    rows = trainer.compute_logprobs(as_data(prompts, results))
    sampled = torch.tensor([x for r in results for x in r.logprobs])
    recomputed = torch.tensor(
        [x for p, row in zip(prompts, rows, strict=True) for x in row[len(p) :]]
    )
    kl = mismatch_kl(recomputed[None], sampled[None], torch.ones(1, len(sampled)))
    max_diff = float((sampled - recomputed).abs().max())
    return {"max_diff": max_diff, "kl": float(kl), "sync_s": sync_s}


def peak_mib(device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a (CPU)"
    return f"{torch.cuda.max_memory_allocated() / 2**20:.0f}"


def fresh_start(device: torch.device) -> None:
    """Free the previous configuration's workers and restart the peak-memory count."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_config(setup: Setup, mode: str, dtype: str) -> dict[str, Any]:
    """One (mode, precision): sampling, training, agreement after a sync, peak memory."""
    fresh_start(setup.device)
    spec = setup.spec(mode, dtype)
    sampler, trainer = HFSampler(spec), TorchTrainer(spec)
    sampling = measure_sampling(sampler, setup.prompts, setup.new_tokens, setup.device)
    data = as_data(setup.prompts, sampler.sample(setup.prompts, setup.new_tokens, 1.0, seed=1))
    training = measure_training(trainer, data, setup.steps)
    agreement = measure_agreement(sampler, trainer, setup.prompts, setup.new_tokens)
    result = {"mode": mode, "dtype": dtype, **sampling, **training, **agreement}
    return result | {"peak": peak_mib(setup.device)}


def deepspeed_section(setup: Setup) -> list[str]:
    """ZeRO-2 on one GPU (NCCL), bf16 autocast over float32 master weights."""
    if setup.device.type != "cuda":
        return [
            "skipped: DeepSpeed ZeRO-2 with NCCL needs CUDA (the gloo/CPU path is tested in "
            "tests/test_deepspeed.py)"
        ]
    if importlib.util.find_spec("deepspeed") is None:
        return ["skipped: deepspeed is not importable here"]
    from flowrl.backends.engines.deepspeed_trainer import DeepSpeedTrainer

    fresh_start(setup.device)
    spec = setup.spec("full", "bfloat16")
    sampler, trainer = HFSampler(spec), DeepSpeedTrainer(spec)
    data = as_data(setup.prompts, sampler.sample(setup.prompts, setup.new_tokens, 1.0, seed=1))
    t = measure_training(trainer, data, setup.steps)
    a = measure_agreement(sampler, trainer, setup.prompts, setup.new_tokens)
    header = ["trainer", "precision", "steps", "s/step", "tokens/s", "max abs logp diff"]
    row = ["DeepSpeed ZeRO-2, NCCL", "bfloat16", str(setup.steps + 1), f"{t['s_step']:.3f}"]
    row += [f"{t['train_tok_s']:.0f}", f"{a['max_diff']:.1e}", f"{a['kl']:.1e}"]
    return table([*header, "mismatch KL", "peak GPU MiB"], [[*row, peak_mib(setup.device)]])


def vllm_section(setup: Setup) -> list[str]:
    """vLLM sampling and its agreement with a bf16 ``TorchTrainer`` after a full weight sync."""
    if setup.device.type != "cuda":
        return ["skipped: the vLLM sampler needs CUDA"]
    if importlib.util.find_spec("vllm") is None:
        return ["skipped: vllm is not importable here"]
    from flowrl.backends.engines.vllm_sampler import VLLMSampler

    fresh_start(setup.device)
    spec = setup.spec("full", "bfloat16")
    hf = measure_sampling(HFSampler(spec), setup.prompts, setup.new_tokens, setup.device)
    fresh_start(setup.device)
    sampler, trainer = VLLMSampler(spec, gpu_memory_utilization=0.3), TorchTrainer(spec)
    s = measure_sampling(sampler, setup.prompts, setup.new_tokens, setup.device)
    a = measure_agreement(sampler, trainer, setup.prompts, setup.new_tokens)
    header = ["sampler", "precision", "tokens/s", "x HF", "time to first token (s)"]
    row = ["vLLM", "bfloat16", f"{s['sample_tok_s']:.0f}"]
    row += [f"{s['sample_tok_s'] / hf['sample_tok_s']:.1f}", f"{s['ttft']:.3f}"]
    row += [f"{a['sync_s']:.3f}", f"{a['max_diff']:.1e}", f"{a['kl']:.1e}"]
    return table([*header, "weight sync (s)", "max abs logp diff", "mismatch KL"], [row])


def environment(args: argparse.Namespace, model_dir: str) -> list[str]:
    """Device, driver and versions, for the table's header."""
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("transformers", "peft", "deepspeed", "vllm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)  # no import: deepspeed's pulls mlflow
    if args.device == "cuda":
        device = f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}, driver {_driver()})"
    else:
        device = (
            f"CPU: {platform.processor() or platform.machine()}, {args.threads} torch thread(s)"
        )
    params = json.loads((Path(model_dir) / "config.json").read_text())
    shape = {k: params[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")}
    return [
        f"- device: {device}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- model: random-weight Qwen2, size `{args.size}` {shape}; group size {GROUP}",
    ]


def _driver() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """Markdown table lines."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def report(args: argparse.Namespace, header: list[str], results: list[dict], sections) -> str:
    """The markdown report: environment, the three per-configuration tables, the sections."""
    done = [r for r in results if "error" not in r]
    sampling = [
        [r["mode"], r["dtype"], f"{r['sample_tok_s']:.0f}", f"{r['ttft']:.3f}", str(r["tokens"])]
        for r in done
    ]
    training = [
        [r["mode"], r["dtype"], f"{r['s_step']:.3f}", f"{r['train_tok_s']:.0f}", r["peak"]]
        for r in done
    ]
    agreement = [
        [r["mode"], r["dtype"], f"{r['max_diff']:.1e}", f"{r['kl']:.1e}"]
        + [f"{r['step_mismatch_kl']:.1e}", f"< {KL_TARGET[r['dtype']]:.0e}"]
        + ["yes" if r["kl"] < KL_TARGET[r["dtype"]] else "NO"]
        for r in done
    ]
    failed = [r for r in results if "error" in r]
    agreement += [[r["mode"], r["dtype"], f"error: {r['error']}", "", "", "", "NO"] for r in failed]
    lines = [f"# GPU check: `gpu_check.py --device {args.device} --size {args.size}`", ""]
    lines += [*header, "", f"## Sampling (HF generate, group size {GROUP}, temperature 1)", ""]
    header_s = ["mode", "precision", "tokens/s", "time to first token (s)", "new tokens"]
    lines += table(header_s, sampling)
    lines += ["", "## Training (one `ppo_clip` step on the group; tokens: prompt + completion)"]
    header_t = ["mode", "precision", "s/step", "tokens/s", "peak GPU MiB (sampler + trainer)"]
    lines += ["", *table(header_t, training)]
    lines += ["", "## Sampler vs trainer log-probs after a weight sync", ""]
    header_a = ["mode", "precision", "max abs logp diff", "mismatch KL"]
    header_a += ["train/mismatch_kl, step 1", "KL target", "meets"]
    lines += table(header_a, agreement)
    for title, body in sections:
        lines += ["", f"## {title}", "", *body]
    return "\n".join(lines) + "\n"


def check(args: argparse.Namespace, work: str) -> tuple[str, int]:
    """Every configuration and section; the report and the number of failures."""
    model_dir = build_model(args.size, f"{work}/model", torch.device(args.device))
    question = [{"role": "user", "content": SIZES[args.size]["question"]}]
    prompts = [HFChatFormat.from_folder(model_dir).encode_prompt(question)] * GROUP
    setup = Setup(args, model_dir, work, prompts)
    failures, results = 0, []
    for mode in MODES:
        for dtype in PRECISIONS:
            try:
                result = run_config(setup, mode, dtype)
                failures += result["kl"] >= KL_TARGET[dtype]
            except Exception as err:  # noqa: BLE001 - report every configuration
                traceback.print_exc()
                result, failures = {"mode": mode, "dtype": dtype, "error": repr(err)}, failures + 1
            results.append(result)
            print(f"{mode} {dtype}: {result}", flush=True)
    sections = []
    for title, section in (
        ("DeepSpeed ZeRO-2 on one GPU", deepspeed_section),
        ("vLLM", vllm_section),
    ):
        try:
            body = section(setup)
        except Exception as err:  # noqa: BLE001 - the report says which section failed
            traceback.print_exc()
            body, failures = [f"error: {err!r}"], failures + 1
        print(f"{title}: " + " / ".join(body), flush=True)
        sections.append((title, body))
    return report(args, environment(args, model_dir), results, sections), failures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=tuple(SIZES), default="qwen2-0.5b")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads")
    parser.add_argument("--out", help="markdown file to write (the table is printed either way)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no GPU visible: run with --device cpu, or on a machine with CUDA")
        return 2
    with tempfile.TemporaryDirectory(prefix="flowrl-gpu-check-") as work:
        text, failures = check(args, work)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return failures


if __name__ == "__main__":
    sys.exit(main())
