"""A real local stack on 127.0.0.1, one command up and one down.

``flowrl stack up`` starts, in order: ``moto_server`` (the S3 endpoint, with a bucket), an
MLflow tracking server (SQLite backend, artifacts proxied to S3), a Prefect server, a Ray head,
then applies the scheduler declaration and the deployments and starts a process worker on the
pool. Each component runs in its own process group; PIDs, ports and the environment a client
needs are kept in ``<FLOWRL_HOME>/stack/state.json``, and a pointer to that file in the user's
config folder (``<FLOWRL_CONFIG_DIR>/stack.json``, default ``~/.config/flowrl/stack.json``) lets a
client in any directory find the stack. ``flowrl stack down`` stops them by PID in reverse order
(the worker before the Prefect server) and removes both files. ``docs/stack.md`` says how
production swaps each one.

A client (``flowrl jobs``, ``flowrl infra up``) finds its Prefect API in this order:
``PREFECT_API_URL`` / ``FLOWRL_PREFECT_API_URL`` if set; else the running stack of
``<FLOWRL_HOME>/stack/state.json``; else the running stack the pointer names. With none of them
it stops with ``NoStackError`` and writes nothing.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flowrl.infra.niceness import RAY_WORKER_NICENESS, yield_cpu_to_workers
from flowrl.infra.servers import TEST_CREDENTIALS, free_port, wait_for_http
from flowrl.infra.settings import get_settings

HOST = "127.0.0.1"
BUCKET = "flowrl"
BIN = Path(sys.executable).parent
REPOSSESSOR_LOOP_SECONDS = 5
WORKER_QUERY_SECONDS = 1  # Prefect's default of 10 s would dominate submission -> start
MLFLOW_UI_PAGE = "#/experiments?workflowType=machine_learning"
STOP_ORDER = ("openai", "tinker", "worker", "ray", "prefect", "mlflow", "moto")
POINTER_NAME = "stack.json"
# Flow runs started by the stack's worker send no task-run INFO lines to the API (one "Finished
# in state Completed()" per stage and step drowned the flow's own lines); task-run warnings and
# errors still go, and the flow-run logger stays at INFO. Prefect reads any key of its
# logging.yml from PREFECT_LOGGING_<PATH>_<TO>_<KEY>.
PREFECT_DATABASE_TIMEOUT_S = 60
TASK_RUN_LOG_LEVEL = {"PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL": "WARNING"}


class NoStackError(RuntimeError):
    """No Prefect API is set and no local stack is running: a client has nothing to talk to."""


@dataclass
class Component:
    pid: int
    url: str
    log: str


@dataclass
class StackState:
    """What ``stack up`` started and what a client needs to use it."""

    components: dict[str, Component] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def ui(self) -> dict[str, str]:
        """Links for a browser: ``prefect`` (the Prefect UI, the server's root, not ``/api``)
        and ``mlflow`` (the MLflow UI), for the components that were started."""
        links = {}
        if "prefect" in self.components:
            links["prefect"] = self.components["prefect"].url.removesuffix("api")
        if "mlflow" in self.components:
            # The experiments list in the "Model training" view (MLflow 3.17's UI opens in its
            # GenAI view unless the link asks; it keeps the choice as one moves on).
            links["mlflow"] = self.components["mlflow"].url.rstrip("/") + "/" + MLFLOW_UI_PAGE
        return links

    def running(self) -> bool:
        """Every component's process is alive."""
        return bool(self.components) and all(_alive(c.pid) for c in self.components.values())

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        # ``ui`` is written for scripts reading the file; it is recomputed on load.
        path.write_text(json.dumps({**asdict(self), "ui": self.ui}, indent=2))

    @classmethod
    def load(cls, path: Path) -> StackState | None:
        if not path.exists():
            return None
        data = json.loads(path.read_text())
        comps = {k: Component(**v) for k, v in data["components"].items()}
        return cls(components=comps, env=data["env"])


def stack_dir() -> Path:
    return get_settings().resolved_home / "stack"


def state_file() -> Path:
    """The state file of the stack under ``FLOWRL_HOME``."""
    return stack_dir() / "state.json"


def pointer_file() -> Path:
    """``<FLOWRL_CONFIG_DIR>/stack.json``: names the state file of the stack started last."""
    return get_settings().resolved_config_dir / POINTER_NAME


def read_pointer() -> Path | None:
    """The state file the pointer names; None without a readable pointer."""
    try:
        return Path(json.loads(pointer_file().read_text())["state_file"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_pointer(path: Path) -> None:
    pointer = pointer_file()
    pointer.parent.mkdir(parents=True, exist_ok=True)
    home = str(path.parent.parent)
    pointer.write_text(json.dumps({"state_file": str(path), "home": home}, indent=2) + "\n")


def _remove_pointer(path: Path) -> None:
    """Remove the pointer if it names ``path`` (a later stack elsewhere keeps its own)."""
    if read_pointer() == path:
        pointer_file().unlink(missing_ok=True)


def known_state_file() -> Path | None:
    """The state file ``stack status|env|down`` act on: the one under ``FLOWRL_HOME`` if it
    exists, else the one the pointer names; None if neither exists."""
    for path in (state_file(), read_pointer()):
        if path is not None and path.exists():
            return path
    return None


def find_stack() -> StackState:
    """The running local stack: the one under ``FLOWRL_HOME``, else the one the pointer
    names. Raises ``NoStackError`` (one line, naming what to do) if none is running."""
    own = state_file()
    pointed = read_pointer()
    stopped: list[StackState] = []
    for path in (own, pointed) if pointed not in (None, own) else (own,):
        state = StackState.load(path)
        if state is not None and state.running():
            return state
        if state is not None:
            stopped.append(state)
    if stopped:
        home = stopped[0].env.get("FLOWRL_HOME", str(get_settings().resolved_home))
        raise NoStackError(
            f"the flowrl stack in {home} is not running (some of its processes exited) and no "
            f"Prefect API is set; restart it with `FLOWRL_HOME={home} flowrl stack up` "
            "or set PREFECT_API_URL"
        )
    raise NoStackError(
        "no flowrl stack is running and no Prefect API is set; start one with "
        "`flowrl stack up` or set PREFECT_API_URL"
    )


def _spawn(name: str, cmd: list[str], env: dict[str, str], state: StackState, url: str) -> int:
    log = stack_dir() / f"{name}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=str(Path(__file__).resolve().parent.parent),
            start_new_session=True,  # its own process group: stopped as a whole, by PID
        )
    state.components[name] = Component(pid=proc.pid, url=url, log=str(log))
    state.save(state_file())
    return proc.pid


def _wait_tcp(port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex((HOST, port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on {HOST}:{port} after {timeout} s")


def _alive(pid: int) -> bool:
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our own exited child
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def stop_component(name: str, comp: Component, timeout: float = 20.0) -> None:
    """SIGINT (the worker; the Ray head, which `ray start --block` ignores SIGTERM for) or
    SIGTERM to the component's process group; SIGKILL if it lingers."""
    sig = signal.SIGINT if name in ("worker", "ray") else signal.SIGTERM
    for s in (sig, signal.SIGKILL):
        try:
            os.killpg(comp.pid, s)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _alive(comp.pid):
                return
            time.sleep(0.2)


def default_gpus() -> int:
    """GPU slots of a local stack without ``--gpus``: the declaration's ``pool.gpus`` (2 in
    ``infra/scheduler.yaml``; ``FLOWRL_POOL_GPUS`` overrides it)."""
    from flowrl.infra.scheduler import load_scheduler

    return load_scheduler().pool.gpus


def stack_up(
    gpus: int | None = None, deploy: bool = True, ray: bool = True, progress: bool = False
) -> StackState:
    """Start every component (idempotent: a running stack is returned as is); ``progress``
    prints a line to stderr as each one is up, with the seconds it took.

    ``gpus`` (default ``default_gpus()``) is both the pool's GPU slots and the Ray head's
    ``--num-gpus``: logical GPUs on a machine without any, so a job asking for
    ``resources.gpus=1`` is admitted and its actors, given a logical GPU, run on the CPU."""
    existing = StackState.load(state_file())
    if existing and existing.running():
        _write_pointer(state_file())
        return existing
    if existing:
        stack_down()
    stack_dir().mkdir(parents=True, exist_ok=True)
    state = StackState()
    gpus = default_gpus() if gpus is None else gpus
    try:
        _start_all(state, gpus, deploy, ray, _Progress(progress))
    except BaseException:
        _stop_all(state)
        state_file().unlink(missing_ok=True)
        raise
    _write_pointer(state_file())
    return state


class _Progress:
    """``flowrl stack up``'s lines on stderr: what is starting, then how long it took."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = self.last = time.monotonic()

    def __call__(self, what: str) -> None:
        if self.enabled:
            now = time.monotonic()
            print(f"  {what:<44} {now - self.last:5.1f} s", file=sys.stderr, flush=True)
            self.last = now


def _start_all(state: StackState, gpus: int, deploy: bool, ray: bool, say: _Progress) -> None:
    home = stack_dir()
    s3 = {**TEST_CREDENTIALS}
    port = free_port()
    moto_url = f"http://{HOST}:{port}"
    pid = _spawn(
        "moto", [str(BIN / "moto_server"), "-H", HOST, "-p", str(port)], {}, state, moto_url
    )
    wait_for_http(f"{moto_url}/moto-api/", 30)
    request = urllib.request.Request(f"{moto_url}/{BUCKET}", method="PUT")
    urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=10).close()
    s3["AWS_ENDPOINT_URL"] = moto_url
    say(f"S3 (moto) on {moto_url}, bucket {BUCKET}")

    port = free_port()
    mlflow_url = f"http://{HOST}:{port}"
    cmd = [str(BIN / "mlflow"), "server", "--host", HOST, "--port", str(port), "--workers", "1"]
    cmd += ["--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}"]
    cmd += ["--artifacts-destination", f"s3://{BUCKET}/mlflow"]
    mlflow_env = {
        **s3,
        "MLFLOW_S3_ENDPOINT_URL": moto_url,
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    _spawn("mlflow", cmd, mlflow_env, state, mlflow_url)

    port = free_port()
    prefect_url = f"http://{HOST}:{port}/api"
    prefect_env = {
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # The UI in a browser talks to this server's API, on whatever port it got.
        "PREFECT_SERVER_UI_API_URL": prefect_url,
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
        # Expired GPU-slot leases (a killed job's) are reclaimed every 5 s, not every 15 s.
        "PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": str(REPOSSESSOR_LOOP_SECONDS),
        # SQLite takes one writer at a time: a busy job's task runs and logs hold the lock in
        # turns, and a write that waits past this many seconds answers 503 (Prefect's default:
        # 10 s). (A write that began as a read fails at once whatever the wait: that needs
        # fewer writes per step, or Postgres, as in production.)
        "PREFECT_SERVER_DATABASE_TIMEOUT": str(PREFECT_DATABASE_TIMEOUT_S),
    }
    cmd = [str(BIN / "prefect"), "server", "start", "--host", HOST, "--port", str(port)]
    _spawn("prefect", cmd, prefect_env, state, prefect_url)
    wait_for_http(f"{mlflow_url}/health", 120)
    say(f"MLflow server on {mlflow_url}")
    wait_for_http(f"{prefect_url}/health", 180)
    say(f"Prefect server on {prefect_url}")

    state.env = {
        **s3,
        "PREFECT_API_URL": prefect_url,
        "FLOWRL_PREFECT_API_URL": prefect_url,
        "FLOWRL_MLFLOW_TRACKING_URI": mlflow_url,
        "FLOWRL_STORAGE_URL": f"s3://{BUCKET}/storage",
        "FLOWRL_HOME": str(get_settings().resolved_home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
    }
    # Admission matches placement: the pool's GPU slots are the GPUs the Ray head offers, so
    # a job asking for more is refused at submission instead of waiting forever.
    state.env["FLOWRL_POOL_GPUS"] = str(gpus)
    if get_settings().scheduler_file is not None:
        state.env["FLOWRL_SCHEDULER_FILE"] = str(get_settings().scheduler_file.resolve())
    if ray:
        port = free_port()
        # A short temp dir: Ray's unix socket paths must stay under ~107 characters.
        ray_tmp = tempfile.mkdtemp(prefix="flowrl-ray-")
        cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", HOST]
        cmd += ["--port", str(port), "--num-cpus", str(get_settings().ray_num_cpus)]
        cmd += ["--num-gpus", str(gpus), "--include-dashboard", "false"]
        cmd += ["--disable-usage-stats", "--temp-dir", ray_tmp]
        cmd += ["--system-config", json.dumps({"worker_niceness": RAY_WORKER_NICENESS})]
        ray_pid = _spawn("ray", cmd, {"RAY_USAGE_STATS_ENABLED": "0"}, state, f"{HOST}:{port}")
        _wait_tcp(port, 120)
        yield_cpu_to_workers([ray_pid], get_settings().ray_daemon_niceness)
        say(f"Ray head on {HOST}:{port} ({gpus} GPUs)")
        # Ray 2.60 has token auth on by default; drivers joining the head must use it too.
        state.env |= {"FLOWRL_RAY_ADDRESS": f"{HOST}:{port}", "RAY_AUTH_MODE": "token"}
    state.save(state_file())
    _apply_infra(state, deploy)
    say("work pool, queues, gpu limit" + (", deployments" if deploy else ""))
    pool = _pool_name(state)
    cmd = [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process"]
    worker_env = {
        **state.env,
        "PREFECT_WORKER_QUERY_SECONDS": str(WORKER_QUERY_SECONDS),
        # Flow logs reach the Prefect API at INFO (the CLI quiets its own terminal); task-run
        # logs at WARNING.
        "PREFECT_LOGGING_LEVEL": "INFO",
        **TASK_RUN_LOG_LEVEL,
        "PREFECT_HOME": str(stack_dir() / "worker-home"),
    }
    pid = _spawn("worker", cmd, worker_env, state, prefect_url)
    time.sleep(1.0)
    if not _alive(pid):
        raise RuntimeError(f"the Prefect worker exited at once; see {stack_dir() / 'worker.log'}")
    say(f"worker on pool {pool}")
    if ray:
        _start_tinker(state, say)
    _start_openai(state, say)


def _start_tinker(state: StackState, say: _Progress) -> None:
    """The Tinker API (``flowrl serve tinker --placement sessions``): each training model a run
    of the ``tinker-session`` deployment. With ``FLOWRL_TINKER_KEYS`` set, those keys; else
    without keys, on loopback (any ``tml-`` key is accepted, every caller one namespace)."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    cmd = [str(BIN / "flowrl"), "serve", "tinker", "--placement", "sessions"]
    cmd += ["--host", HOST, "--port", str(port)]
    if not os.environ.get("FLOWRL_TINKER_KEYS"):
        cmd.append("--insecure-loopback")
    state.env["TINKER_BASE_URL"] = url
    pid = _spawn("tinker", cmd, state.env, state, url)
    wait_for_http(f"{url}/api/v1/healthz", 120)
    if not _alive(pid):
        raise RuntimeError(f"the Tinker API exited at once; see {stack_dir() / 'tinker.log'}")
    say(f"Tinker API on {url}")


def _start_openai(state: StackState, say: _Progress) -> None:
    """The OpenAI-compatible endpoint (``flowrl serve openai``) on the stack's MLflow and
    storage: its registered versions, Tinker checkpoints and base models. With
    ``FLOWRL_OPENAI_KEYS`` set, those keys; else without keys, on loopback. It loads a model on
    its first request, so at rest it holds none."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    cmd = [str(BIN / "flowrl"), "serve", "openai", "--host", HOST, "--port", str(port)]
    if not os.environ.get("FLOWRL_OPENAI_KEYS"):
        cmd.append("--insecure-loopback")
    state.env["OPENAI_BASE_URL"] = f"{url}/v1"
    pid = _spawn("openai", cmd, state.env, state, url)
    wait_for_http(f"{url}/health", 120)
    if not _alive(pid):
        raise RuntimeError(f"the OpenAI endpoint exited at once; see {stack_dir() / 'openai.log'}")
    say(f"OpenAI-compatible endpoint on {url}/v1")


def _child_env(state: StackState) -> dict[str, str]:
    return {**os.environ, **state.env}


def _apply_infra(state: StackState, deploy: bool) -> None:
    """``flowrl infra up`` against the new server, in a child process (clean Prefect settings)."""
    cmd = [sys.executable, "-m", "flowrl", "infra", "up"]
    if not deploy:
        cmd.append("--no-deployments")
    root = Path(__file__).resolve().parent.parent
    subprocess.run(cmd, env=_child_env(state), cwd=root, check=True, stdout=subprocess.DEVNULL)


def _pool_name(state: StackState) -> str:
    from flowrl.infra.scheduler import load_scheduler

    return load_scheduler().pool.name


def _stop_all(state: StackState) -> None:
    for name in STOP_ORDER:
        if name in state.components:
            stop_component(name, state.components[name])


def stack_down(path: Path | None = None) -> list[str]:
    """Stop what the state file lists (default: the one under ``FLOWRL_HOME``), worker first;
    remove the state file and the pointer to it."""
    path = path or state_file()
    state = StackState.load(path)
    if state is None:
        return []
    _stop_all(state)
    path.unlink(missing_ok=True)
    _remove_pointer(path)
    return [n for n in STOP_ORDER if n in state.components]


def apply_stack_env() -> StackState | None:
    """Point this process at the running local stack (``find_stack``) unless a Prefect API is
    set (``PREFECT_API_URL`` or ``FLOWRL_PREFECT_API_URL``), which wins: returns the stack
    used, or None when an API was set. Raises ``NoStackError`` when neither exists, having
    written nothing."""
    if os.environ.get("PREFECT_API_URL") or os.environ.get("FLOWRL_PREFECT_API_URL"):
        return None
    state = find_stack()
    os.environ.update(state.env)
    return state
