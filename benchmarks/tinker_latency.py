"""Per-call latency of the Tinker verbs through the self-hosted service (official ``tinker`` SDK
-> HTTP -> the service's futures) versus the same verbs on a ``TinkerModel`` in this process.

    python benchmarks/tinker_latency.py --out docs/benchmarks/tinker_latency.md

The service runs as ``flowrl serve tinker --insecure-loopback`` in a child process (as deployed:
local placement, the model in the server's process); the in-process model is built from the same
tiny base model with the same LoRA rank and seed. Both use one torch thread. Verbs:

- ``forward_backward``: a batch of 8 datums of 16 tokens, ``cross_entropy``; submit, ``result()``;
- ``sample``: a 16-token prompt, ``num_samples`` 4, ``max_tokens`` 8 (no stop tokens, so every
  sequence is 8 tokens), temperature 1, from a sampler snapshot of the adapter;
- SL step: ``forward_backward`` + ``optim_step`` submitted together, both results awaited.

Milliseconds per call: median and p90 of ``--calls`` calls after ``--warmup`` calls, all in one
run, the two sides interleaved in blocks so drift touches both alike.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

KEY = "tml-benchmark-" + "b" * 24  # any tml- key is accepted by --insecure-loopback
BATCH, LENGTH = 8, 16
NUM_SAMPLES, MAX_TOKENS = 4, 8
LR = 1e-4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(port: int, env: dict[str, str]) -> subprocess.Popen:
    flowrl = Path(sys.executable).with_name("flowrl")
    cmd = [str(flowrl), "serve", "tinker", "--insecure-loopback", "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited: {proc.stderr.read().decode()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("the service did not listen within 120 s")


def _stats(times: list[float]) -> tuple[float, float]:
    ms = np.asarray(times) * 1000
    return float(np.median(ms)), float(np.percentile(ms, 90))


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(calls: int, warmup: int, block: int, home: Path) -> dict[str, dict[str, list[float]]]:
    import torch
    from tinker import ServiceClient
    from tinker import types as tt

    from flowrl.backends.engines.tinker.model import TinkerModel
    from flowrl.backends.engines.tinker.types import Datum, SampleParams, tinker_lora
    from flowrl.backends.models.tinker_checkpoints import resolve_base_model
    from flowrl.infra.settings import get_settings

    torch.set_num_threads(1)
    rng = random.Random(0)
    seqs = [[rng.randrange(9, 100) for _ in range(LENGTH + 1)] for _ in range(BATCH)]
    prompt = [rng.randrange(9, 100) for _ in range(LENGTH)]

    # In this process: the engine's own types.
    model = TinkerModel(
        resolve_base_model("tiny", get_settings().model_cache_dir), tinker_lora(rank=16), seed=0
    )
    local_data = [
        Datum(
            s[:-1],
            {
                "target_tokens": np.asarray(s[1:], dtype=np.int64),
                "weights": np.ones(LENGTH, dtype=np.float32),
            },
        )
        for s in seqs
    ]
    model.snapshot("bench")
    local_params = SampleParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=0)

    # Through the service: the SDK's types.
    port = _free_port()
    env = os.environ | {"FLOWRL_HOME": str(home), "OMP_NUM_THREADS": "1"}
    server = _start_server(port, env)
    try:
        client = ServiceClient(base_url=f"http://127.0.0.1:{port}", api_key=KEY)
        training = client.create_lora_training_client("flowrl/tiny", rank=16, seed=0).result()
        data = [
            tt.Datum(
                model_input=tt.ModelInput.from_ints(s[:-1]),
                loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * LENGTH},
            )
            for s in seqs
        ]
        sampler = training.save_weights_and_get_sampling_client().result()
        remote_params = tt.SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, stop=[], seed=0)
        remote_prompt = tt.ModelInput.from_ints(prompt)
        adam = tt.AdamParams(learning_rate=LR)

        def remote_step() -> None:
            fb = training.forward_backward(data, "cross_entropy")
            opt = training.optim_step(adam)
            fb.result()
            opt.result()

        def local_step() -> None:
            model.forward_backward(local_data, "cross_entropy")
            model.optim_step(LR)

        verbs: dict[str, dict[str, Callable[[], Any]]] = {
            "forward_backward": {
                "in-process": lambda: model.forward_backward(local_data, "cross_entropy"),
                "service": lambda: training.forward_backward(data, "cross_entropy").result(),
            },
            "sample": {
                "in-process": lambda: model.sample(prompt, NUM_SAMPLES, local_params, "bench"),
                "service": lambda: sampler.sample(
                    remote_prompt, NUM_SAMPLES, remote_params
                ).result(),
            },
            "SL step (forward_backward + optim_step)": {
                "in-process": local_step,
                "service": remote_step,
            },
        }
        # A sampled sequence must run to max_tokens on both sides (no stop tokens).
        got = sampler.sample(remote_prompt, NUM_SAMPLES, remote_params).result().sequences
        assert all(len(s.tokens) == MAX_TOKENS for s in got), [len(s.tokens) for s in got]
        got_local = model.sample(prompt, NUM_SAMPLES, local_params, "bench").sequences
        assert all(len(s.tokens) == MAX_TOKENS for s in got_local)

        times: dict[str, dict[str, list[float]]] = {}
        for verb, sides in verbs.items():
            times[verb] = {side: [] for side in sides}
            for fn in sides.values():
                for _ in range(warmup):
                    fn()
            while len(times[verb]["service"]) < calls:
                for side, fn in sides.items():
                    times[verb][side] += [_timed(fn) for _ in range(block)]
            # The service's gradients accumulated over its forward_backward calls: clear them.
            training.optim_step(adam).result()
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return times


def machine() -> str:
    import tinker
    import torch

    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (
        f"{os.cpu_count()} CPU cores ({cpu}), {platform.system()} {platform.machine()}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, "
        f"tinker {tinker.__version__}"
    )


def render(times: dict[str, dict[str, list[float]]], args: argparse.Namespace) -> str:
    now = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Tinker API latency: through the service vs in-process",
        "",
        f"- date: {now}; `python benchmarks/tinker_latency.py --out {args.out}`",
        f"- machine: {machine()}",
        "- model: `flowrl/tiny` (random-weight Llama, hidden 128, 2 layers, vocab 104), "
        "LoRA rank 16; one torch thread on each side",
        "- service: `flowrl serve tinker --insecure-loopback` in a child process (local "
        "placement), reached with the official `tinker` SDK over loopback HTTP "
        "(request, future id, `retrieve_future`); in-process: the same verbs on a "
        "`TinkerModel` directly",
        f"- batch: forward_backward {BATCH} datums x {LENGTH} tokens (`cross_entropy`); sample "
        f"num_samples {NUM_SAMPLES}, max_tokens {MAX_TOKENS}, {LENGTH}-token prompt, no stop "
        f"tokens, from an adapter snapshot; SL step = forward_backward + optim_step, both "
        f"results awaited",
        f"- {args.calls} calls per side after {args.warmup} warm-up calls, the sides "
        f"alternating in blocks of {args.block}; milliseconds per call",
        "",
        "| verb | in-process median | in-process p90 | service median | service p90 "
        "| overhead (median) | service / in-process |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for verb, sides in times.items():
        lm, lp = _stats(sides["in-process"])
        sm, sp = _stats(sides["service"])
        lines.append(
            f"| {verb} | {lm:.1f} | {lp:.1f} | {sm:.1f} | {sp:.1f} | {sm - lm:+.1f} "
            f"| {sm / lm:.2f}x |"
        )
    lines += [
        "",
        "The overhead is the service's per call: the SDK's serialisation, one HTTP request "
        "that answers a future id, the work queued on the model's worker thread, and the "
        "long-polled `retrieve_future` that brings the result back (two futures for an SL "
        "step). On a 2-core machine the client, the server's event loop and the model's "
        "worker share the cores.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="docs/benchmarks/tinker_latency.md")
    p.add_argument("--calls", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--block", type=int, default=5)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory(prefix="tinker-latency-") as home:
        os.environ["FLOWRL_HOME"] = home
        times = measure(args.calls, args.warmup, args.block, Path(home))
    text = render(times, args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
