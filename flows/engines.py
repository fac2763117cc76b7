"""What a job's process connects to before its flow runs: Ray (``connect_ray``) and, on a
machine without a Prefect API, Prefect's temporary server; ``start_engines`` begins both side
by side while a command imports the flow."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import ray
from ray._private import auto_init_hook

from flowrl.infra import ray_auth
from flowrl.infra.niceness import RAY_SYSTEM_CONFIG, yield_cpu_to_workers
from flowrl.infra.settings import RAY_NAMESPACE, get_settings

LOCAL_RAY_SYSTEM_CONFIG = RAY_SYSTEM_CONFIG
"""A local Ray's system config: the stack's head's (``infra.niceness``)."""


RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
"""Ray's notice that its token authentication is on (it is: flowrl keeps Ray's default)."""

RAY_WAIT_S = 45.0
"""How long a job waits for an unreachable Ray head (the stack's supervisor restarts a dead
one in seconds) before it ends CRASHED, to be resumed."""


class InfrastructureError(RuntimeError):
    """Something under the job failed, not the job: the Ray head does not answer, Ray lost
    the job's workers. The run ends CRASHED (``infrastructure_fault``), which the stack's
    automation resumes from the last checkpoint."""


_early_ray: Future[bool] | None = None
"""``connect_ray`` begun by ``start_engines`` in a thread, for the job's runner to take."""


def start_engines() -> Callable[[], None]:
    """Begin what a job run in this process connects to, so that they boot side by side while
    the caller imports the flow's modules: Ray (``connect_ray``, in a thread; the job's runner
    then takes this Ray as the one it started, and stops it) and, where no Prefect API is
    configured, Prefect's temporary server (the process its client would start at the flow's
    first call, after everything else; ``_TemporaryPrefectAPI``). Call it before importing a
    flow; call what it returns before running the flow: it opens the MLflow store meanwhile,
    waits until both are up, and raises what failed. The CLI's job commands do this (command
    to first step: docs/benchmarks/cpu_tax.md)."""
    global _early_ray
    # Off the main thread ray.init leaves the SIGTERM handler alone (as it should here: the
    # command's own stays) and warns that it did.
    logging.getLogger("ray._private.worker").addFilter(_NoSigtermWarning())
    api = None if os.environ.get("PREFECT_API_URL") else _TemporaryPrefectAPI()
    _early_ray = ray_started = Future()
    threading.Thread(target=_start_ray, args=(ray_started,), name="ray-start", daemon=True).start()

    def ready() -> None:
        from flowrl.infra import tracking

        if api is not None:  # first: its migrations and MLflow's share alembic's module state
            api.adopt()
        tracking.client()  # the MLflow store opens while Ray finishes booting
        ray_started.result()  # raised again where the runner takes it

    return ready


class _TemporaryPrefectAPI:
    """Prefect's temporary API: the app Prefect's own temporary server runs
    (``create_app(ephemeral=True, final=True)``: the API without its UI, the services an
    ephemeral server runs), served by uvicorn from a daemon thread of this process, begun at
    once so that it boots while the command imports the flow. ``adopt`` waits until it
    answers and hands it to Prefect, whose client then uses it as the one it would have
    started (``SubprocessASGIServer``: a process of its own, which held ~180 MB; served here it
    adds ~20-30 MB to this process, whose Prefect, SQLAlchemy and alembic it shares:
    docs/benchmarks/footprint.md). At exit it gets a second to stop; what it served is in its
    database by then (the flow's and task runs' final states).

    Its port is bound here, before the thread starts, and handed to uvicorn as a socket: no
    other process can take it between the choice and the bind. (Serving again after a taken
    port, as this did before, served Prefect's cached app a second time, whose lifespan then
    starts none of the services: not the task-run recorder, not the automations' triggers; a
    benchmark's flow run was left with no task run recorded.)"""

    def __init__(self) -> None:
        self._failed: BaseException | None = None
        self._closed = threading.Event()
        self._server: Any = None  # uvicorn's, once the thread has built the app
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self._thread = threading.Thread(target=self._serve, name="prefect-api", daemon=True)
        self._thread.start()
        atexit.register(self._stop)  # a command that ends before ``adopt`` leaves no server

    def _serve(self) -> None:
        try:
            import uvicorn
            from prefect.server.api.server import create_app

            app = create_app(ephemeral=True, final=True)
            config = uvicorn.Config(app, log_level="error", lifespan="on")
            self._server = uvicorn.Server(config)
            if not self._closed.is_set():
                self._server.run(sockets=[self._socket])
        except BaseException as err:  # noqa: BLE001 - raised again by ``adopt``
            self._failed = err
        finally:
            self._socket.close()

    def _stop(self) -> None:
        self._closed.set()  # still importing: it will not serve
        if self._server is not None and self._thread.is_alive():
            self.terminate()
            self._thread.join(1)

    # What Prefect calls on the server process it would have started (``SubprocessASGIServer``).
    def poll(self) -> int | None:
        return None if self._thread.is_alive() else 0

    def terminate(self) -> None:
        if self._server is not None:
            self._server.should_exit = True

    def wait(self, timeout: float | None = None) -> int:
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise subprocess.TimeoutExpired("prefect-api", timeout or 0.0)
        return 0

    def kill(self) -> None:
        self.terminate()  # a thread cannot be killed: it is a daemon, it ends with the process

    def adopt(self, timeout_s: float = 120.0) -> None:
        from prefect.server.api.server import SubprocessASGIServer
        from prefect.settings import PREFECT_API_URL

        if PREFECT_API_URL.value():  # a Prefect profile names an API: the client uses that one
            self._stop()
            return
        deadline = time.monotonic() + timeout_s
        while not (self._server is not None and self._server.started):
            if self._failed is not None or not self._thread.is_alive():
                raise RuntimeError("Prefect's temporary API did not start") from self._failed
            if time.monotonic() > deadline:
                self._stop()
                raise TimeoutError(f"Prefect's temporary API did not answer in {timeout_s} s")
            time.sleep(0.05)
        server = SubprocessASGIServer()
        server.port, server.server_process, server.running = self.port, self, True


def _start_ray(started: Future[bool]) -> None:
    """``connect_ray`` into ``started``, then stay: Ray starts its processes to die with the
    thread that started them (Linux's parent-death signal), so this thread lives as long as
    the process (a daemon thread: it does not keep the process alive)."""
    _run_into(started, connect_ray)
    if started.exception() is None:
        threading.Event().wait()


def _run_into(future: Future, fn: Callable[[], Any]) -> None:
    try:
        future.set_result(fn())
    except BaseException as e:  # noqa: BLE001 - handed to the caller of ready()
        future.set_exception(e)


class _NoSigtermWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("SIGTERM handler is not set")


def connect_ray() -> bool:
    """Connect this process to Ray (see ``RayStageRunner``); True if it started one.

    Only here: from now on nothing in this process starts a Ray of its own (Ray's auto-init
    is turned off), so a stage thread still running while a stopped job shuts its Ray down
    fails at once instead of starting a second, fresh local Ray. A local Ray runs its workers
    at niceness 0 and its helper daemons at ``FLOWRL_RAY_DAEMON_NICENESS``
    (``infra.niceness``). A Ray that ``start_engines`` began is waited for and counts as
    started here."""
    global _early_ray
    auto_init_hook.enable_auto_connect = False
    early = _early_ray
    if early is not None and threading.current_thread() is threading.main_thread():
        _early_ray = None
        return early.result()
    if ray.is_initialized():
        return False
    s = get_settings()
    env = {"env_vars": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}}
    init: dict[str, Any] = {"namespace": RAY_NAMESPACE, "log_to_driver": False, "runtime_env": env}
    if os.environ.get("FLOWRL_VERBOSE") != "1":  # Ray's start-up notices stay off the terminal
        init["logging_level"] = logging.WARNING
        logging.getLogger(RAY_AUTH_LOGGER).setLevel(logging.ERROR)
    if s.ray_address is not None:
        _wait_for_head(s.ray_address)
        try:
            with _keep_sigterm_handler():
                ray.init(address=s.ray_address, **init)
        except (ConnectionError, TimeoutError, ray.exceptions.RaySystemError) as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise InfrastructureError(f"Ray at {s.ray_address} refused the job: {first}") from err
        return True
    init |= {"num_cpus": s.ray_num_cpus, "include_dashboard": False}
    if s.ray_num_gpus is not None:
        init["num_gpus"] = s.ray_num_gpus
    init["_system_config"] = LOCAL_RAY_SYSTEM_CONFIG
    ray_auth.ensure_token()
    with _keep_sigterm_handler():
        ray.init(address="local", **init)
    if s.ray_local_daemons == "needed":
        _stop_unused_daemons()
    yield_cpu_to_workers(_started_here(), s.ray_daemon_niceness)
    return True


def _wait_for_head(address: str, wait_s: float = RAY_WAIT_S) -> None:
    """Wait up to ``wait_s`` for the Ray head's GCS port to accept a connection; raise
    ``InfrastructureError`` in one line if it does not (``ray.init`` would retry for minutes).
    A ``ray://`` client address is left to ``ray.init``."""
    import socket

    if "://" in address or ":" not in address:
        return
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host, int(port)), timeout=2.0):
                return
        except OSError as err:
            if time.monotonic() > deadline:
                raise InfrastructureError(
                    f"the Ray head at {address} does not answer (waited {wait_s:.0f} s: {err})"
                ) from None
            time.sleep(1.0)


def infrastructure_fault(err: BaseException) -> str | None:
    """One line saying what failed under the job, if ``err`` is the platform's failure rather
    than the job's: ``InfrastructureError``, Ray losing the job's processes or its head, or a
    server of the platform that does not answer (``tracking.is_outage``)."""
    lost = (
        ray.exceptions.RayActorError,
        ray.exceptions.WorkerCrashedError,
        ray.exceptions.NodeDiedError,
        ray.exceptions.ObjectLostError,
        ray.exceptions.RaySystemError,
    )
    if isinstance(err, InfrastructureError):
        return str(err)
    text = str(err).strip()
    first = text.splitlines()[0][:300] if text else ""
    if isinstance(err, ray.exceptions.RayActorError) and err.actor_init_failed:
        return None  # the actor's own __init__ raised: the job's error, every attempt alike
    if isinstance(err, lost):
        return f"Ray lost the job's workers ({type(err).__name__}: {first})"
    from flowrl.infra.tracking import is_outage

    if is_outage(err):  # MLflow (or another server of the platform) did not answer
        return f"a server of the platform did not answer ({type(err).__name__}: {first})"
    return None


def _stop_unused_daemons() -> None:
    """Stop the local Ray's daemons no job uses (``Settings.ray_local_daemons``): the log
    monitor, the autoscaler monitor and the dashboard head. The GCS, the raylet and its agents
    stay (the raylet lives and dies with its agents)."""
    with contextlib.suppress(AttributeError):  # Ray's node: not a public API
        node = ray._private.worker._global_node
        for stop in (node.kill_log_monitor, node.kill_monitor, node.kill_dashboard):
            with contextlib.suppress(Exception):  # one already gone, or never started
                stop(check_alive=False)


def _started_here() -> list[int]:
    """The processes of the local Ray this process just started (GCS, monitors, dashboard,
    raylet: its agents and workers are the raylet's children), nothing else it may have
    started."""
    with contextlib.suppress(AttributeError):  # Ray's node: not a public API
        node = ray._private.worker._global_node
        return [info.process.pid for infos in node.all_processes.values() for info in infos]
    return []


@contextlib.contextmanager
def _keep_sigterm_handler() -> Iterator[None]:
    """``ray.init`` replaces the SIGTERM handler with its own ``sys.exit``: put back the
    Python handler there was. In a flow run that is Prefect's, which takes the worker's SIGTERM
    after a cancel as the cancel (CANCELLED, ``on_cancellation`` hooks) rather than as a crash
    (CRASHED, "Execution was aborted by Python system exit call")."""
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if callable(previous) and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous)
