"""Issue 42's "tenancy and bad input" race against the OpenAI-compatible endpoint: many clients
at once, valid requests mixed with every kind of bad one; no answer may be a 5xx or a dropped
connection, each kind must get its own status (a 4xx naming what is wrong), and a valid request
must still succeed afterwards.

    python benchmarks/openai_race.py [--clients 32] [--seconds 60] [--out FILE.md]

The endpoint runs as a user runs it: ``flowrl serve openai`` in a process of its own, keyed for
two namespaces (``FLOWRL_OPENAI_KEYS=alice:…,bob:…``) on a fresh ``FLOWRL_HOME``, where alice
owns a registered version (``models:/race/1``: the catalogue's tiny model, registered in MLflow
as her ``race``). Each client (a thread with its own keep-alive connection) draws request kinds
from ``PROBES`` with its own fixed seed until the time is up. Tallied per kind: the statuses,
answers whose status or body is not the expected one (a valid answer's content, a refusal's
detail naming the field), and per run the 5xx, connection errors and timeouts (all must be 0)
and the tracebacks in the endpoint's log (an exception after a stream began shows only there).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
KEYS = {"alice": "race-alice-" + "a" * 24, "bob": "race-bob-" + "b" * 24}
BASE = "flowrl/tiny"
REGISTERED = "models:/race/1"
"""Alice's registered version (``alice_race`` in MLflow); bob has no ``race``."""
MAX_N = 16  # the endpoint's default --max-n
OVERSIZED = 2**20 + 4096  # over the default --max-body-bytes (1 MiB)
HI = [{"role": "user", "content": "What is 12 + 7?"}]
TITLE = "The OpenAI-compatible endpoint under a race of bad input (issue 42)"
RUN_WITH = (
    "Each run: `flowrl serve openai` (alice's and bob's keys, default limits) on the catalogue's "
    "tiny model and alice's registered `models:/race/1`; clients draw request kinds at random "
    "(fixed seeds) until the time is up. Expected: each kind its status, no 5xx, no dropped "
    "connection, and a valid request answered afterwards.\n"
)


# ------------------------------------------------------------------------------ requests


@dataclass
class Call:
    """One request: method, path, whose key (None: no key), body bytes, extra headers, and what
    the answer's ``detail`` must name (a refusal) or a check of a valid answer's body."""

    method: str
    path: str
    key: str | None = "alice"
    body: bytes | Iterator[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    names: str | None = None
    check: Callable[[httpx.Response], bool] | None = None


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()  # ensure_ascii: a lone surrogate stays a \\ud800 escape


def _chat(model: str = BASE, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": HI, "max_tokens": 4} | extra


def _answered(response: httpx.Response) -> bool:
    choices = response.json().get("choices") or []
    return bool(choices) and all("message" in c or "text" in c for c in choices)


def _streamed(response: httpx.Response) -> bool:
    events = [e for e in response.text.split("\n\n") if e]
    if not events or events[-1] != "data: [DONE]":
        return False
    return all("choices" in json.loads(e.removeprefix("data: ")) for e in events[:-1])


def _lists(present: bool) -> Callable[[httpx.Response], bool]:
    return lambda r: (REGISTERED in {m["id"] for m in r.json()["data"]}) == present


def valid_chat(rng: random.Random) -> Call:
    body = _chat(
        rng.choice([BASE, REGISTERED]),
        max_tokens=rng.randint(1, 8),
        temperature=rng.choice([0, 0.7, 1.0]),
        n=rng.randint(1, 2),
        seed=rng.choice([None, rng.randint(0, 2**31)]),
    )
    return Call("POST", "/v1/chat/completions", body=_json(body), check=_answered)


def valid_stream(rng: random.Random) -> Call:
    body = _chat(rng.choice([BASE, REGISTERED]), max_tokens=rng.randint(1, 8), stream=True)
    return Call("POST", "/v1/chat/completions", body=_json(body), check=_streamed)


def valid_completion(rng: random.Random) -> Call:
    prompt = rng.choice(["12+7=", "The answer is", [5, 6, 7, 8]])
    body = {"model": rng.choice([BASE, REGISTERED]), "prompt": prompt, "max_tokens": 4}
    body["stream"] = rng.random() < 0.3
    return Call(
        "POST",
        "/v1/completions",
        body=_json(body),
        check=_streamed if body["stream"] else _answered,
    )


def bob_chat(rng: random.Random) -> Call:
    return Call("POST", "/v1/chat/completions", "bob", _json(_chat()), check=_answered)


def list_models(rng: random.Random) -> Call:
    key = rng.choice(["alice", "bob"])
    return Call("GET", "/v1/models", key, check=_lists(key == "alice"))


def other_namespace_model(rng: random.Random) -> Call:
    if rng.random() < 0.3:
        return Call("GET", f"/v1/models/{REGISTERED}", "bob", names=REGISTERED)
    return Call("POST", "/v1/chat/completions", "bob", _json(_chat(REGISTERED)), names=REGISTERED)


def unknown_model(rng: random.Random) -> Call:
    name = rng.choice(
        ["no-such-model", "gpt-4o", "/etc/passwd", "../../model", "models:/nope/1",
         "models:/race/99", "tinker://0123456789abcdef:train:0/sampler_weights/x"]
    )  # fmt: skip
    return Call("POST", "/v1/chat/completions", body=_json(_chat(name)), names=name)


def no_key(rng: random.Random) -> Call:
    headers = rng.choice([
        {},
        {"Authorization": "Bearer wrong-key-" + "x" * 20},
        {"Authorization": "Basic YWxpY2U6YQ=="},
        {"X-API-Key": "short"},
    ])  # fmt: skip
    return Call("POST", "/v1/chat/completions", None, _json(_chat()), headers, names="key")


def malformed_json(rng: random.Random) -> Call:
    body = rng.choice([b'{"model": "flowrl/tiny", "messages": [', b"{not json", b"", b"\xff\xfe{}"])
    return Call("POST", "/v1/chat/completions", body=body, names="not JSON")


def deep_json(rng: random.Random) -> Call:
    depth = rng.randint(2_000, 100_000)
    opening, closing = rng.choice([(b"[", b"]"), (b'{"a":', b"}")])
    return Call("POST", "/v1/completions", body=opening * depth + b"1" + closing * depth)


def lone_surrogate(rng: random.Random) -> Call:
    text = rng.choice(["\ud800", "a\udfffb"])
    body = rng.choice([
        _chat(messages=[{"role": "user", "content": text}]),
        {"model": BASE, "prompt": text, "max_tokens": 2},
        _chat(max_tokens=text),
        _chat(**{text: 1}),
    ])  # fmt: skip
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    return Call("POST", path, body=_json(body), names="surrogate")


def not_object(rng: random.Random) -> Call:
    body = rng.choice([b"[1, 2]", b'"hi"', b"3", b"null", b"true"])
    return Call("POST", "/v1/chat/completions", body=body, names="not a JSON object")


def wrong_types(rng: random.Random) -> Call:
    name, body = rng.choice([
        ("model", _chat(["flowrl/tiny"])),
        ("messages", _chat(messages="hi")),
        ("messages[0]", _chat(messages=[["user", "hi"]])),
        ("content", _chat(messages=[{"role": "user", "content": 5}])),
        ("role", _chat(messages=[{"role": "robot", "content": "hi"}])),
        ("max_tokens", _chat(max_tokens="8")),
        ("n:", _chat(n="2")),
        ("temperature", _chat(temperature="hot")),
        ("temperature", _chat(temperature=float("nan"))),
        ("stop", _chat(stop=5)),
        ("seed", _chat(seed="x")),
        ("prompt", {"model": BASE, "prompt": {"text": "hi"}}),
        ("prompt", {"model": BASE, "prompt": [-1, 3]}),
        ("prompt", {"model": BASE, "prompt": [10**12]}),
    ])  # fmt: skip
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    return Call("POST", path, body=_json(body), names=name)


def n_over_limit(rng: random.Random) -> Call:
    body = _chat(n=rng.choice([MAX_N + 1, 100, 10**6]))
    return Call("POST", "/v1/chat/completions", body=_json(body), names="n:")


def unsupported(rng: random.Random) -> Call:
    name, value = rng.choice([
        ("top_p", 0.5), ("logit_bias", {"1": 5}), ("response_format", {"type": "json_object"}),
        ("presence_penalty", 0.5), ("frequency_penalty", 1.0), ("top_logprobs", 3),
        ("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "required"),
        ("functions", [{"name": "f"}]), ("best_of", 2),
    ])  # fmt: skip
    return Call("POST", "/v1/chat/completions", body=_json(_chat(**{name: value})), names=name)


def context_overflow(rng: random.Random) -> Call:
    if rng.random() < 0.5:
        long = [{"role": "user", "content": "x" * rng.randint(1_000, 200_000)}]
        return Call(
            "POST", "/v1/chat/completions", body=_json(_chat(messages=long)), names="context"
        )
    body = {"model": BASE, "prompt": [7] * rng.randint(256, 5_000), "max_tokens": 1}
    return Call("POST", "/v1/completions", body=_json(body), names="context")


def huge_max_tokens(rng: random.Random) -> Call:
    key = rng.choice(["max_tokens", "max_completion_tokens"])
    body = _chat(**{key: rng.choice([250, 2_048, 2_049, 10**6, 10**30])})
    return Call("POST", "/v1/chat/completions", body=_json(body), names="max_tokens")


def oversized(rng: random.Random) -> Call:
    body = _json(_chat(messages=[{"role": "user", "content": "x" * OVERSIZED}]))
    return Call("POST", "/v1/chat/completions", body=body, names="over")


def no_length(rng: random.Random) -> Call:
    chunks = iter([b'{"model": "flowrl/tiny", ', b'"messages": []}'])  # chunked: no length
    return Call("POST", "/v1/chat/completions", body=chunks, names="Content-Length")


def wrong_method(rng: random.Random) -> Call:
    method, path = rng.choice([
        ("GET", "/v1/chat/completions"),
        ("GET", "/v1/completions"),
        ("DELETE", "/v1/models/flowrl/tiny"),
        ("PUT", "/v1/completions"),
    ])  # fmt: skip
    return Call(method, path, body=_json(_chat()) if method == "PUT" else None)


def wrong_path(rng: random.Random) -> Call:
    path = rng.choice(["/v1/embeddings", "/v1/responses", "/v2/models", "/v1/chat", "/admin"])
    return Call(rng.choice(["GET", "POST"]), path, body=b"{}")


@dataclass(frozen=True)
class Probe:
    """A request kind: how often it is drawn, the statuses it must get, how it is built."""

    kind: str
    weight: int
    expect: tuple[int, ...]
    build: Callable[[random.Random], Call]


PROBES = [
    Probe("chat completion", 10, (200,), valid_chat),
    Probe("chat completion, streamed", 6, (200,), valid_stream),
    Probe("text completion", 6, (200,), valid_completion),
    Probe("bob's chat completion", 3, (200,), bob_chat),
    Probe("model list (alice sees race, bob not)", 3, (200,), list_models),
    Probe("bob asks alice's models:/race/1", 4, (404,), other_namespace_model),
    Probe("unknown model", 4, (404,), unknown_model),
    Probe("missing or wrong key", 3, (401,), no_key),
    Probe("malformed JSON", 3, (422,), malformed_json),
    Probe("JSON nested 2k-100k deep", 2, (422,), deep_json),
    Probe("lone surrogate escape in a string", 2, (422,), lone_surrogate),
    Probe("body not an object", 2, (422,), not_object),
    Probe("wrong types", 5, (400,), wrong_types),
    Probe("n over the limit", 2, (400,), n_over_limit),
    Probe("unsupported parameter", 4, (400,), unsupported),
    Probe("prompt over the context", 3, (400,), context_overflow),
    Probe("huge max_tokens", 2, (400,), huge_max_tokens),
    Probe("oversized body (> 1 MiB)", 1, (413,), oversized),
    Probe("no Content-Length (chunked)", 1, (411,), no_length),
    Probe("wrong method", 2, (405,), wrong_method),
    Probe("wrong path", 2, (404,), wrong_path),
]


# ---------------------------------------------------------------------------- the race


@dataclass
class Tally:
    """One request kind's answers."""

    statuses: Counter = field(default_factory=Counter)
    unexpected: int = 0
    """Answers with another status than expected, or whose body failed its check."""
    examples: list[str] = field(default_factory=list)
    latencies_s: list[float] = field(default_factory=list)

    def add(self, other: Tally) -> None:
        self.statuses.update(other.statuses)
        self.unexpected += other.unexpected
        self.examples += other.examples[: 3 - len(self.examples)]
        self.latencies_s += other.latencies_s


@dataclass
class Race:
    """What the race saw: a tally per kind, transport failures, and the endpoint afterwards."""

    clients: int
    seconds: float
    tallies: dict[str, Tally] = field(default_factory=dict)
    transport_errors: Counter = field(default_factory=Counter)
    """Connection errors and timeouts by exception type (no answer at all)."""
    after: dict[str, int] = field(default_factory=dict)
    """Status of a valid request on each model after the race."""
    server_alive: bool = True
    server_tracebacks: int = 0

    @property
    def requests(self) -> int:
        return sum(t.statuses.total() for t in self.tallies.values())

    @property
    def server_errors(self) -> int:
        return sum(n for t in self.tallies.values() for s, n in t.statuses.items() if s >= 500)

    @property
    def unexpected(self) -> int:
        return sum(t.unexpected for t in self.tallies.values())

    def passed(self) -> bool:
        return (
            self.server_errors == self.unexpected == self.server_tracebacks == 0
            and not self.transport_errors
            and self.server_alive
            and all(s == 200 for s in self.after.values())
            and all(self.tallies.get(p.kind) for p in PROBES)
        )


def _verdict(call: Call, expect: tuple[int, ...], response: httpx.Response) -> str | None:
    """Why this answer is not the expected one, or None."""
    if response.status_code not in expect:
        return f"{response.status_code} {response.text[:160]!r}"
    try:
        if call.check is not None and not call.check(response):
            return f"{response.status_code}: unexpected body {response.text[:160]!r}"
        if call.names is not None and call.names not in response.json().get("detail", ""):
            return f"{response.status_code}: detail does not name {call.names!r}: {response.text}"
    except Exception as err:  # noqa: BLE001 - an answer the check cannot read is not expected
        return f"{response.status_code}: {type(err).__name__} reading {response.text[:160]!r}"
    return None


def _client_loop(url: str, seed: int, deadline: float, tallies: dict, errors: Counter) -> None:
    rng = random.Random(seed)
    weights = [p.weight for p in PROBES]
    with httpx.Client(base_url=url, timeout=120) as client:
        while time.monotonic() < deadline:
            probe = rng.choices(PROBES, weights)[0]
            call = probe.build(rng)
            headers = dict(call.headers)
            if call.key is not None:
                headers["Authorization"] = f"Bearer {KEYS[call.key]}"
            if call.body is not None:
                headers.setdefault("Content-Type", "application/json")
            start = time.perf_counter()
            try:
                response = client.request(
                    call.method, call.path, content=call.body, headers=headers
                )
            except httpx.TransportError as err:
                errors[f"{probe.kind}: {type(err).__name__}"] += 1
                continue
            tally = tallies.setdefault(probe.kind, Tally())
            tally.latencies_s.append(time.perf_counter() - start)
            tally.statuses[response.status_code] += 1
            why = _verdict(call, probe.expect, response)
            if why is not None:
                tally.unexpected += 1
                if len(tally.examples) < 3:
                    tally.examples.append(f"{call.method} {call.path}: {why}"[:400])


def race(url: str, clients: int, seconds: float, seed: int = 42) -> Race:
    """``clients`` threads drawing from ``PROBES`` against the endpoint at ``url`` for
    ``seconds``; client i draws with seed ``seed + i``."""
    deadline = time.monotonic() + seconds
    per_client = [({}, Counter()) for _ in range(clients)]
    threads = [
        threading.Thread(target=_client_loop, args=(url, seed + i, deadline, *per_client[i]))
        for i in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    result = Race(clients, seconds)
    for tallies, errors in per_client:
        for kind, tally in tallies.items():
            result.tallies.setdefault(kind, Tally()).add(tally)
        result.transport_errors.update(errors)
    return result


def after_the_race(url: str) -> dict[str, int]:
    """The status of one valid greedy chat completion on each model, as alice."""
    headers = {"Authorization": f"Bearer {KEYS['alice']}"}
    return {
        model: httpx.post(
            f"{url}/v1/chat/completions",
            json=_chat(model, temperature=0),
            headers=headers,
            timeout=120,
        ).status_code
        for model in (BASE, REGISTERED)
    }


# ------------------------------------------------------------------------ the endpoint


@contextmanager
def _environment(**values: str | None) -> Iterator[None]:
    """``os.environ`` with ``values`` set (None: unset), restored afterwards."""
    saved = {k: os.environ.get(k) for k in values}
    try:
        _set_environment(values)
        yield
    finally:
        _set_environment(saved)


def _set_environment(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _home_environment(home: Path) -> dict[str, str | None]:
    """The settings that point flowrl (MLflow, storage) at ``home`` and nowhere else."""
    unset = ("FLOWRL_NAMESPACE", "FLOWRL_MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_URI")
    return {"FLOWRL_HOME": str(home), "FLOWRL_STORAGE_URL": None} | dict.fromkeys(unset)


def register_version(home: Path) -> str:
    """Register the catalogue's tiny model as version 1 of alice's ``race`` in ``home``'s MLflow
    (what a training job of hers registers, without the training); returns its MLflow URI."""
    with _environment(**_home_environment(home) | {"FLOWRL_NAMESPACE": "alice"}):
        from flowrl.backends.models.mlflow_model import save_chat_model
        from flowrl.backends.models.tinker_checkpoints import resolve_base_model
        from flowrl.infra import tracking
        from flowrl.infra.settings import get_settings, scoped_model_name

        folder = resolve_base_model("tiny", get_settings().model_cache_dir)
        lineage = tracking.Lineage(job="openai-race", kind="benchmark", base_model="tiny")
        run = tracking.start_run("openai-race", "openai-race", {}, None, "alice")
        with tempfile.TemporaryDirectory() as tmp:
            save_chat_model(folder, f"{tmp}/model", HI)
            name = scoped_model_name(REGISTERED.split("/")[1], "alice")
            uri = tracking.register_policy(run, folder, f"{tmp}/model", name, {}, lineage)
        tracking.end_run(run)
    return uri


@contextmanager
def endpoint(home: Path) -> Iterator[tuple[str, subprocess.Popen]]:
    """``flowrl serve openai`` on a free loopback port with alice's and bob's keys, on
    ``home``; yields its URL and process, and stops it (by its PID) afterwards."""
    from flowrl.infra.servers import free_port, wait_for_http

    port = free_port()
    keys = ",".join(f"{ns}:{key}" for ns, key in KEYS.items())
    env = {k: v for k, v in os.environ.items() if k not in _home_environment(home)}
    env |= {k: v for k, v in _home_environment(home).items() if v is not None}
    env |= {"FLOWRL_OPENAI_KEYS": keys, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "flowrl", "serve", "openai", "--port", str(port)]
    with open(home / "endpoint.log", "wb") as log:
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{url}/health", timeout=120, process=server)
        yield url, server
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(30)


def run(home: Path, clients: int, seconds: float, seed: int = 42) -> Race:
    """The whole check on a fresh ``home``: register alice's version, start the endpoint, warm
    both models up (the first request of a model loads it), race, check it still answers."""
    register_version(home)
    with endpoint(home) as (url, server):
        warm = after_the_race(url)
        if any(s != 200 for s in warm.values()):
            raise RuntimeError(f"the endpoint does not answer valid requests: {warm}")
        result = race(url, clients, seconds, seed)
        result.after = after_the_race(url)
        result.server_alive = server.poll() is None
    result.server_tracebacks = (
        (home / "endpoint.log").read_text(errors="replace").count("Traceback")
    )
    return result


# ------------------------------------------------------------------------------ report


def render(result: Race) -> str:
    lines = [
        "| request kind | expected | requests | statuses | median ms | as expected |",
        "|---|--:|--:|---|--:|--:|",
    ]
    for probe in PROBES:
        tally = result.tallies.get(probe.kind, Tally())
        statuses = ", ".join(f"{s} × {n}" for s, n in sorted(tally.statuses.items())) or "–"
        median = statistics.median(tally.latencies_s) * 1e3 if tally.latencies_s else 0.0
        total = tally.statuses.total()
        lines.append(
            f"| {probe.kind} | {'/'.join(map(str, probe.expect))} | {total} | {statuses} | "
            f"{median:.0f} | {total - tally.unexpected} of {total} |"
        )
    errors = ", ".join(f"{k} × {n}" for k, n in result.transport_errors.items()) or "0"
    after = ", ".join(f"{m} {s}" for m, s in result.after.items())
    lines += [
        "",
        f"- {result.requests} requests from {result.clients} clients in {result.seconds:g} s "
        f"({result.requests / result.seconds:.0f}/s)",
        f"- 5xx: {result.server_errors}; connection errors and timeouts: {errors}; "
        f"tracebacks in the endpoint's log: {result.server_tracebacks}",
        f"- answers not as expected: {result.unexpected}",
        f"- after the race: endpoint {'running' if result.server_alive else 'DEAD'}; a valid "
        f"chat completion as alice: {after}",
        f"- verdict: {'PASS' if result.passed() else 'FAIL'}",
    ]
    for probe in PROBES:
        for example in result.tallies.get(probe.kind, Tally()).examples:
            lines.append(f"- unexpected ({probe.kind}): `{example}`")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", help="markdown file to append the report to")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flowrl-openai-race-") as home:
        result = run(Path(home), args.clients, args.seconds, args.seed)
    table = render(result)
    print(table)
    if args.out:
        command = " ".join(["python benchmarks/openai_race.py", *map(shlex.quote, sys.argv[1:])])
        machine = f"{os.cpu_count()} CPUs ({platform.machine()}, {platform.system()}), no GPU"
        header = (
            f"\n## {datetime.now(UTC):%Y-%m-%d %H:%M} UTC — `{command}`\n\n- machine: {machine}; "
            "the endpoint with 1 torch thread\n\n"
        )
        out = Path(args.out)
        title = "" if out.exists() else f"# {TITLE}\n\n{RUN_WITH}"
        with out.open("a") as f:
            f.write(title + header + table)
    sys.exit(0 if result.passed() else 1)


if __name__ == "__main__":
    main()
