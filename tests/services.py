"""Servers a test starts as an operator would, on free loopback ports, stopped by PID: the
environment service (``python -m flowrl.environments.service``) and a Ray cluster head; and the
Tinker API in the test's own process (``TinkerServer``: uvicorn in a thread)."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from flowrl.infra.ray_auth import ensure_token
from flowrl.infra.servers import free_port, wait_for_http
from flowrl.infra.serving import BackgroundServer

REPO = Path(__file__).resolve().parents[1]


def start_env_service(
    *serves: str,
    env: dict[str, str] | None = None,
    options: tuple[str, ...] = ("--insecure-loopback",),
) -> tuple[str, subprocess.Popen]:
    """The service serving ``serves`` (``--env`` each; none = every installed environment),
    started with ``env`` (default: this process's) and ``options`` (default: no tokens, on
    loopback); returns (base URL, process)."""
    port = free_port()
    args = [a for name in serves for a in ("--env", name)] + list(options)
    proc = subprocess.Popen(
        [sys.executable, "-m", "flowrl", "serve", "environments", "--port", str(port), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_for_http(f"{url}/health", timeout=60, process=proc)
    return url, proc


@contextlib.contextmanager
def ray_head(env: dict[str, str], num_cpus: int = 8) -> Iterator[str]:
    """A Ray cluster head on loopback (``ray start --head --block``, its own process group),
    as an operator starts one; workers get ``env`` (e.g. the ``PYTHONPATH`` holding a user's
    package, as an image would). Yields its address; stopped by PID (SIGTERM to the group,
    SIGKILL if it lingers)."""
    ensure_token()  # made once: a fresh machine's first clusters, started at once, share it
    port = free_port()
    temp = tempfile.mkdtemp(prefix="flowrl-ray-")  # short: Ray's socket paths stay < 107 chars
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block"]
    cmd += ["--node-ip-address", "127.0.0.1", "--port", str(port), "--num-cpus", str(num_cpus)]
    cmd += ["--num-gpus", "0", "--include-dashboard", "false", "--disable-usage-stats"]
    with _ray_process([*cmd, "--temp-dir", temp], env, temp):
        deadline = time.monotonic() + 120
        while not _listening(port):
            if time.monotonic() > deadline:
                raise RuntimeError("the Ray head did not start")
            time.sleep(0.2)
        yield f"127.0.0.1:{port}"


@contextlib.contextmanager
def ray_node(address: str, env: dict[str, str], num_cpus: int = 2) -> Iterator[None]:
    """A second node of the cluster at ``address`` on this machine (``ray start --address
    --block``), as an operator adds one; yields once the cluster counts it; stopped by PID."""
    before = _alive_nodes(address, env)
    cmd = [str(Path(sys.executable).with_name("ray")), "start", "--address", address, "--block"]
    cmd += ["--node-ip-address", "127.0.0.1", "--num-cpus", str(num_cpus), "--num-gpus", "0"]
    cmd += ["--disable-usage-stats"]
    with _ray_process(cmd, env, None):
        deadline = time.monotonic() + 120
        while _alive_nodes(address, env) <= before:
            if time.monotonic() > deadline:
                raise RuntimeError("the second Ray node did not join")
            time.sleep(1.0)
        yield


_COUNT_NODES = """
import sys, ray
ray.init(address=sys.argv[1], log_to_driver=False)
print("NODES", sum(1 for n in ray.nodes() if n["Alive"]))
"""


def _alive_nodes(address: str, env: dict[str, str]) -> int:
    out = run_on_cluster(_COUNT_NODES, address, env)
    lines = [x for x in out.stdout.splitlines() if x.startswith("NODES ")]
    return int(lines[-1].split()[1]) if lines else 0


def run_on_cluster(script: str, address: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``python -c script address`` with ``env``: a driver of its own for the cluster at
    ``address`` (the test's process may hold another Ray)."""
    return subprocess.run(
        [sys.executable, "-c", script, address],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def run_flowrl(
    command: str, config: Path, overrides: list[str], env: dict[str, str], timeout: int = 600
) -> subprocess.CompletedProcess:
    """``flowrl COMMAND CONFIG --set o …`` as a user runs it, with ``env``; output captured."""
    flowrl = str(Path(sys.executable).with_name("flowrl"))
    return subprocess.run(
        [flowrl, command, str(config), *(a for o in overrides for a in ("--set", o))],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def _ray_process(cmd: list[str], env: dict[str, str], temp: str | None) -> Iterator[None]:
    """Run a blocking ``ray start`` in its own process group; stop it by PID (SIGTERM to the
    group, SIGKILL if it lingers) and remove its temp folder."""
    proc = subprocess.Popen(
        cmd,
        env={**env, "RAY_USAGE_STATS_ENABLED": "0"},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[1:3]} exited at once ({proc.returncode})")
        yield
    finally:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                continue
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)


def _listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


class AppServer(BackgroundServer):
    """An ASGI app behind uvicorn on a free loopback port, in a thread of this process
    (``infra.serving.BackgroundServer``); ``stop()`` stops the server, then calls ``on_stop``
    (also when it does not start)."""

    def __init__(self, app, on_stop=None) -> None:  # noqa: ANN001 - a FastAPI app, a callable
        self._on_stop = on_stop
        try:
            super().__init__(app)
        except RuntimeError:
            if on_stop is not None:
                on_stop()
            raise

    def stop(self) -> None:
        super().stop()
        if self._on_stop is not None:
            self._on_stop()


class TinkerServer(AppServer):
    """A ``TinkerService`` behind uvicorn (``AppServer``); ``stop()`` stops the server, then
    the service (its models unloaded)."""

    def __init__(self, service) -> None:  # noqa: ANN001 - a flowrl TinkerService
        from flowrl.backends.services.tinker.routes import create_app

        self.service = service
        super().__init__(create_app(service), on_stop=service.close)


def metric_history(run_id: str, metric: str) -> list[float]:
    """An MLflow run's values of ``metric``, in step order (the job's tracking store)."""
    from flowrl.infra.tracking import client

    points = sorted(client().get_metric_history(run_id, metric), key=lambda m: m.step)
    return [m.value for m in points]


def assert_learns(  # noqa: ANN001
    result, steps: int, label: str, min_rise: float = 0.05, min_held_out_rise: float = 0.0
) -> None:
    """The e2e learning bar (tests/test_flow_e2e.py) on an ``rl_train`` result: ``steps`` steps
    logged, mean reward of the last 20 over the first 20 by more than ``min_rise`` (the bar:
    0.05), and held-out accuracy after RL over the one before by more than
    ``min_held_out_rise``; the figures printed under ``label``."""
    import statistics

    rewards = metric_history(result.mlflow_run_id, "reward/mean")
    assert len(rewards) == steps
    first, last = statistics.mean(rewards[:20]), statistics.mean(rewards[-20:])
    print(
        f"\n{label}: reward/mean first 20 steps {first:.3f}, last 20 {last:.3f}; held-out "
        f"accuracy {result.accuracy_start:.3f} -> {result.accuracy_end:.3f}"
    )
    assert last > first + min_rise, (first, last)
    assert result.accuracy_end > result.accuracy_start + min_held_out_rise


@contextlib.contextmanager
def session_endpoint(
    folder: str, cache_dir: str, temperature: float, context_length: int, max_tokens: int
) -> Iterator[tuple]:
    """Rollout sessions (``backends.services.openai_api.sessions``) on the model in ``folder``,
    behind uvicorn, with its sampler and a trainer in this process: (table, server, trainer)."""
    from flowrl.backends.engines.hf_sampler import HFSampler
    from flowrl.backends.engines.torch_trainer import TorchTrainer
    from flowrl.backends.models.chat import HFChatFormat
    from flowrl.backends.services.openai_api.sessions import (
        Batcher,
        SessionTable,
        create_session_app,
    )
    from flowrl.backends.types import WorkerSpec

    spec = WorkerSpec(model_uri=folder, cache_dir=cache_dir)
    sampler, trainer = HFSampler(spec), TorchTrainer(spec)
    batcher = Batcher(lambda p, n, t, s: sampler.sample(p, n, t, s), seed=1)
    table = SessionTable(HFChatFormat.from_folder(folder), batcher, context_length, max_tokens)
    server = AppServer(create_session_app(table, temperature))
    try:
        yield table, server, trainer
    finally:
        server.stop()
        batcher.close()


def session_client(server: AppServer, session) -> Any:  # noqa: ANN001 - a sessions.Session
    """The ``openai`` client an agent would build for ``session``."""
    import openai

    return openai.OpenAI(
        base_url=f"{server.url}/sessions/{session.session_id}/v1",
        api_key=session.key,
        max_retries=0,
    )


def assert_trained_exactly(turns: list, sampled: list[int], trainer, temperature: float) -> Any:  # noqa: ANN001
    """The episode recorded as ``turns`` is one trajectory that trains exactly the ``sampled``
    ids (mask 1 on them and nothing else), with log-probs the trainer recomputes within 1e-5;
    returns that trajectory."""
    import pytest

    from flowrl.agent_loop.recorded import trajectories_from_turns
    from flowrl.backends.types import Datum

    (t,) = trajectories_from_turns(turns, "ep", 0, reward=1.0)
    assert [tok for tok, m in zip(t.tokens, t.loss_mask, strict=True) if m] == sampled
    assert sum(t.loss_mask) == len(sampled) == sum(len(turn.completion) for turn in turns)
    (row,) = trainer.compute_logprobs([Datum(t.tokens, t.loss_mask, 0.0)], temperature)
    recomputed = [lp for lp, m in zip(row, t.loss_mask, strict=True) if m]
    recorded = [lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m]
    assert recomputed == pytest.approx(recorded, abs=1e-5)
    return t


def flowrl_to_a_closed_pipe(
    args: list[str], cwd: Path, env: dict[str, str]
) -> subprocess.CompletedProcess:
    """``python -m flowrl ARGS`` whose stdout reader is gone before the first line, stdout
    block-buffered as a user's shell has it (no PYTHONUNBUFFERED)."""
    env = {k: v for k, v in env.items() if k != "PYTHONUNBUFFERED"}
    read, write = os.pipe()
    os.close(read)
    try:
        return subprocess.run(
            [sys.executable, "-m", "flowrl", *args],
            cwd=cwd,
            env=env,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write)
