"""What the OpenAI-compatible endpoint's HTTP path costs (issue 42): the same chat completions
sampled in-process (``OpenAIService.sample`` on the loaded model, as the endpoint calls it)
and through ``flowrl serve openai`` with the official ``openai`` client, one request at a time.

    python benchmarks/openai_endpoint.py --out docs/benchmarks/openai_endpoint.md

For each size (``tiny``, ``3m``: ``benchmarks/engines.py``'s), the endpoint runs as a user runs
it, in a process of its own (``flowrl serve openai --insecure-loopback``, the model in its
catalogue through ``FLOWRL_TINKER_MODELS``), and the in-process side in this process, both with
2 torch threads on the same random-weight model. Each request: one user message (a 3-digit
sum), ``n`` completions of ``max_tokens`` tokens at temperature 1 with the request's
seed; the same seeds on both sides, so both sample the same tokens. Reported: median latency,
sampled tokens/s, and the HTTP path's added latency (HTTP − in-process, as a share of the
in-process time).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from engines import build_model  # noqa: E402 - the sizes of the engines benchmark

REPO = Path(__file__).resolve().parents[1]
THREADS = 2
SIZES = {"tiny": (8, 32), "3m": (8, 32)}
"""Size → (completions a request, tokens a completion)."""


def wait_ready(url: str, deadline_s: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"the endpoint at {url} did not start")


def http_side(folder: str, messages: list[list[dict]], n: int, tokens: int, port: int) -> list:
    """(latency s, sampled tokens) of each request through ``flowrl serve openai``."""
    import json

    import openai

    env = os.environ | {
        "FLOWRL_TINKER_MODELS": json.dumps({"bench": folder}),
        "OMP_NUM_THREADS": str(THREADS),
        "FLOWRL_HOME": tempfile.mkdtemp(prefix="flowrl-openai-bench-"),
    }
    server = subprocess.Popen(
        [
            str(REPO / ".venv/bin/flowrl"),
            "serve",
            "openai",
            "--insecure-loopback",
            "--port",
            str(port),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_ready(f"http://127.0.0.1:{port}")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        out = []
        for i, m in enumerate([messages[0], *messages]):  # the first loads the model: dropped
            start = time.perf_counter()
            answer = client.chat.completions.create(
                model="bench", messages=m, n=n, max_tokens=tokens, temperature=1.0, seed=i
            )
            out.append((time.perf_counter() - start, answer.usage.completion_tokens))
        return out[1:]
    finally:
        server.terminate()
        server.wait(30)


def local_side(folder: str, messages: list[list[dict]], n: int, tokens: int) -> list:
    """(latency s, sampled tokens) of each request sampled in this process."""
    import torch

    from flowrl.backends.services.openai_api.service import OpenAIService

    torch.set_num_threads(THREADS)
    service = OpenAIService(catalogue={"bench": folder}, storage_url=tempfile.mkdtemp())
    served = service.model(None, "bench")
    out = []
    for i, m in enumerate([messages[0], *messages]):
        start = time.perf_counter()
        prompt = served.chat.encode_prompt(m)
        body = {"n": n, "max_tokens": tokens, "temperature": 1.0, "seed": i}
        completions = service.sample(served, prompt, body)
        out.append((time.perf_counter() - start, sum(len(c.tokens) for c in completions)))
    return out[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--port", type=int, default=18795)
    parser.add_argument("--out", help="markdown file to write (the table is printed either way)")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    home = Path(tempfile.mkdtemp(prefix="flowrl-openai-models-"))
    rows = []
    for size in args.sizes:
        n, tokens = SIZES[size]
        folder, params = build_model(size, home)
        messages = [
            [{"role": "user", "content": f"What is {100 + 7 * i} + {300 + 11 * i}?"}]
            for i in range(args.requests)
        ]
        local = local_side(folder, messages, n, tokens)
        http = http_side(folder, messages, n, tokens, args.port)
        rows.append((size, params, n, tokens, local, http))
    report = render(rows, args.requests)
    print(report)
    if args.out:
        Path(args.out).write_text(report)


def render(rows: list, requests: int) -> str:
    lines = [
        "# The OpenAI-compatible endpoint: what the HTTP path costs",
        "",
        f"- date: {datetime.now(UTC):%Y-%m-%d %H:%M} UTC; `python benchmarks/openai_endpoint.py "
        f"--requests {requests} --out docs/benchmarks/openai_endpoint.md`",
        f"- machine: {os.cpu_count()} CPUs, no GPU; {THREADS} torch threads on each side",
        f"- {requests} requests one after another (the first, which loads the model, left out); "
        "each one user message (a 3-digit sum), `n` completions at temperature 1 "
        "with the request's seed (the same on both sides)",
        "- in-process: `OpenAIService.sample` on the loaded model in the benchmark's process "
        "(prompt rendering included); HTTP: `flowrl serve openai` in its own process, the "
        "`openai` client here",
        "",
        "| size | parameters | n × max tokens | in-process s (median) | HTTP s (median) | "
        "added by HTTP | in-process tokens/s | HTTP tokens/s |",
        "|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for size, params, n, tokens, local, http in rows:
        lo = statistics.median(t for t, _ in local)
        hi = statistics.median(t for t, _ in http)
        lo_tps = sum(k for _, k in local) / sum(t for t, _ in local)
        hi_tps = sum(k for _, k in http) / sum(t for t, _ in http)
        lines.append(
            f"| {size} | {params / 1e6:.2f}M | {n} × {tokens} | {lo:.3f} | {hi:.3f} | "
            f"{(hi - lo) / lo:+.0%} | {lo_tps:.0f} | {hi_tps:.0f} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
