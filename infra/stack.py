"""A real local stack on 127.0.0.1, one command up and one down, that stays up.

``flowrl stack up`` starts supervisord (``infra/supervise.py``) and, through it, in order:
PostgreSQL (``infra/postgres.py``; the database of Prefect's and MLflow's servers), S3
(SeaweedFS, objects on disk: ``infra/objectstore.py``), an MLflow tracking server (artifacts
proxied to S3), a Prefect server, a Ray head; then it applies the scheduler declaration and the
deployments and starts a process worker on the pool, the resumer (``infra/resumer.py``), the
Tinker API and the OpenAI-compatible endpoint (each program's command, environment and health
check: ``infra/stack_programs.py``). supervisord restarts a component that exits, on the same
port with the same data; its health listener restarts one that stops answering. The data
(``<stack>/postgres``, ``<stack>/s3``) outlives ``stack down``: the next ``stack up`` finds
every run, version, checkpoint and artifact where it was.

PIDs, ports and the environment a client needs are kept in ``<FLOWRL_HOME>/stack/state.json``,
and a pointer to that file in the user's config folder (``<FLOWRL_CONFIG_DIR>/stack.json``,
default ``~/.config/flowrl/stack.json``) lets a client in any directory find the stack.
``flowrl stack down`` stops supervisord, which stops every component (highest priority first:
the services and the worker before the servers they use), and removes both files.
``docs/stack.md`` says how production swaps each one.

A client (``flowrl jobs``, ``flowrl infra up``) finds its Prefect API in this order:
``PREFECT_API_URL`` / ``FLOWRL_PREFECT_API_URL`` if set; else the running stack of
``<FLOWRL_HOME>/stack/state.json``; else the running stack the pointer names. With none of them
it stops with ``NoStackError`` and writes nothing. A stack is running while its supervisor is;
a component that is down (and being restarted) is named by ``ComponentDownError``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from flowrl.infra import objectstore
from flowrl.infra.niceness import yield_cpu_to_workers
from flowrl.infra.postgres import Postgres
from flowrl.infra.servers import wait_for_http
from flowrl.infra.settings import get_settings
from flowrl.infra.stack_programs import BIN, BUCKET, layout
from flowrl.infra.supervise import Supervisor, healthy, read_record
from flowrl.infra.supervise import alive as _alive

MLFLOW_UI_PAGE = "#/experiments?workflowType=machine_learning"
START_ORDER = (
    "postgres",
    "s3",
    "mlflow",
    "prefect",
    "ray",
    "worker",
    "resumer",
    "tinker",
    "openai",
)
STOP_ORDER = tuple(reversed(START_ORDER))
POINTER_NAME = "stack.json"
WHAT = {
    "postgres": "PostgreSQL",
    "s3": "S3 (SeaweedFS)",
    "mlflow": "MLflow server",
    "prefect": "Prefect server",
    "ray": "Ray head",
    "worker": "Prefect worker",
    "resumer": "job resumer",
    "tinker": "Tinker API",
    "openai": "OpenAI-compatible endpoint",
}


class NoStackError(RuntimeError):
    """No Prefect API is set and no local stack is running: a client has nothing to talk to."""


class ComponentDownError(RuntimeError):
    """A component of the running stack does not answer (its supervisor restarts it)."""


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
    supervisor: dict[str, str | int] = field(default_factory=dict)
    """supervisord's ``pid``, ``socket`` and ``home`` (the stack's folder)."""

    @property
    def ui(self) -> dict[str, str]:
        """Links for a browser: ``prefect`` (the Prefect UI, the server's root, not ``/api``)
        and ``mlflow`` (the MLflow UI), for the components that were started."""
        links = {}
        if "prefect" in self.components:
            links["prefect"] = self.components["prefect"].url.removesuffix("api")
        if "mlflow" in self.components:
            # The experiments list in the "Model training" view (MLflow 3.17's UI opens in its
            # GenAI view unless a link asks; it keeps the choice as one moves on).
            links["mlflow"] = self.components["mlflow"].url.rstrip("/") + "/" + MLFLOW_UI_PAGE
        return links

    def running(self) -> bool:
        """The stack's supervisor is alive (its components may be restarting; a stack made
        before supervision: every component's process is alive)."""
        if self.supervisor:
            return _alive(int(self.supervisor["pid"]))
        return bool(self.components) and all(_alive(c.pid) for c in self.components.values())

    def supervisord(self) -> Supervisor | None:
        if not self.supervisor:
            return None
        home = Path(str(self.supervisor["home"]))
        return Supervisor(home, Path(str(self.supervisor["socket"])))

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
        return cls(components=comps, env=data["env"], supervisor=data.get("supervisor") or {})


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
            f"the flowrl stack in {home} is not running (its supervisor exited) and no "
            f"Prefect API is set; start it again with `FLOWRL_HOME={home} flowrl stack up` "
            "(its data is kept) or set PREFECT_API_URL"
        )
    raise NoStackError(
        "no flowrl stack is running and no Prefect API is set; start one with "
        "`flowrl stack up` or set PREFECT_API_URL"
    )


def component_status(state: StackState) -> dict[str, dict]:
    """Each component: ``pid``, ``state`` (supervisord's: RUNNING, STARTING, BACKOFF, ...;
    EXITED for a dead process of an unsupervised stack), ``restarts`` and ``last_reason`` (the
    health listener's record), ``url``, ``log``."""
    sup = state.supervisord()
    live: dict[str, dict] = {}
    record: dict[str, dict] = {}
    if sup is not None and state.running():
        try:
            live = sup.processes()
        except OSError:
            live = {}
        record = read_record(sup.home)
    out = {}
    for name, comp in state.components.items():
        info = live.get(name)
        if info is not None:
            pid, status = int(info["pid"]) or comp.pid, info["statename"]
        else:
            pid, status = comp.pid, "RUNNING" if _alive(comp.pid) else "EXITED"
        entry = record.get(name, {})
        out[name] = {
            "pid": pid,
            "state": status,
            "restarts": entry.get("restarts", 0),
            "last_reason": entry.get("last_reason"),
            "url": comp.url,
            "log": comp.log,
        }
    return out


def check_component(state: StackState, name: str, timeout: float = 15.0) -> None:
    """Raise ``ComponentDownError`` naming ``name``, its address and its state if it does not
    answer its health URL within ``timeout`` seconds."""
    comp = state.components.get(name)
    if comp is None:
        raise ComponentDownError(f"the stack has no {WHAT.get(name, name)}")
    url = _health_url(name, comp.url)
    if url is None:
        return
    try:
        wait_for_http(url, timeout)
    except TimeoutError:
        status = component_status(state).get(name, {})
        why = f"; last: {status['last_reason']}" if status.get("last_reason") else ""
        raise ComponentDownError(
            f"the stack's {WHAT.get(name, name)} at {comp.url} does not answer "
            f"(supervisor: {status.get('state', '?')}, {status.get('restarts', 0)} restarts"
            f"{why}); it is being restarted, try again shortly (`flowrl stack status`)"
        ) from None


def _health_url(name: str, url: str) -> str | None:
    paths = {"mlflow": "/health", "prefect": "/health", "tinker": "/api/v1/healthz"}
    paths |= {"openai": "/health", "s3": "/healthz"}
    if name in paths:
        return url.rstrip("/") + paths[name]
    return None


def default_gpus() -> int:
    """GPU slots of a local stack without ``--gpus``: the declaration's ``pool.gpus`` (2 in
    ``infra/scheduler.yaml``; ``FLOWRL_POOL_GPUS`` overrides it)."""
    from flowrl.infra.scheduler import load_scheduler

    return load_scheduler().pool.gpus


def check_installed() -> None:
    """Every program the stack runs is installed; else ``MissingComponentError``, one line
    naming the first missing piece and the command that installs it."""
    from flowrl.infra.postgres import bin_dir
    from flowrl.infra.servers import MissingComponentError

    bin_dir()
    objectstore.weed_binary()
    for program, package in (("supervisord", "supervisor"), ("mlflow", "mlflow")):
        if not (BIN / program).exists():
            raise MissingComponentError(
                f"the stack's {program} is not installed (the {package} package); install "
                "flowrl's dependencies with `make setup`"
            )


def stack_up(
    gpus: int | None = None, deploy: bool = True, ray: bool = True, progress: bool = False
) -> StackState:
    """Start the stack (idempotent: on a running stack, start only the components that are
    not running and return it); ``progress`` prints a line to stderr as each one is up, with
    the seconds it took. The data of an earlier stack in the same home is used as it is.

    ``gpus`` (default ``default_gpus()``) is both the pool's GPU slots and the Ray head's
    ``--num-gpus``: logical GPUs on a machine without any, so a job asking for
    ``resources.gpus=1`` is admitted and its actors, given a logical GPU, run on the CPU."""
    check_installed()
    say = _Progress(progress)
    existing = StackState.load(state_file())
    if existing and existing.running() and existing.supervisor:
        _start_missing(existing, say)
        _write_pointer(state_file())
        return existing
    if existing:
        stack_down()
    stack_dir().mkdir(parents=True, exist_ok=True)
    state = StackState()
    gpus = default_gpus() if gpus is None else gpus
    try:
        _start_all(state, gpus, deploy, ray, say)
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
            print(f"  {what:<48} {now - self.last:5.1f} s", file=sys.stderr, flush=True)
            self.last = now


def _start_missing(state: StackState, say: _Progress) -> None:
    """``stack up`` on a running stack: start what supervisord holds stopped or given up on,
    then wait until every component answers."""
    sup = state.supervisord()
    assert sup is not None
    live = sup.processes()
    for name in START_ORDER:
        info = live.get(name)
        if info is not None and info["statename"] in ("STOPPED", "EXITED", "FATAL"):
            sup.start(name)
            say(f"{WHAT[name]} started again")
    for name in START_ORDER:
        if name in state.components:
            url = _health_url(name, state.components[name].url)
            if url is not None:
                wait_for_http(url, 180)
    say("every component answers")


def _start_all(state: StackState, gpus: int, deploy: bool, ray: bool, say: _Progress) -> None:
    home = stack_dir()
    settings = get_settings()
    pg = Postgres(home / "postgres")
    pg.ensure_cluster()
    plan = layout(home, pg, gpus, ray, _pool_name(state))
    programs, urls = plan.programs, plan.urls
    state.env = plan.env

    sock = home / "supervisor.sock"
    if len(str(sock)) > 100:  # a Unix socket's path is limited to ~107 bytes
        sock = Path(tempfile.mkdtemp(prefix="flowrl-sv-")) / "supervisor.sock"
    sup = Supervisor(home, sock)
    sup.write(programs)
    (home / "supervision.json").unlink(missing_ok=True)  # restarts count from this start
    # What `flowrl stack env` exported for an earlier stack must not reach this one's programs
    # (RAY_AUTH_MODE=token, say, makes a new Ray head refuse to make its token).
    pid = sup.start_daemon(drop_env=(*state.env, "MLFLOW_TRACKING_URI", "MLFLOW_S3_ENDPOINT_URL"))
    state.supervisor = {"pid": pid, "socket": str(sock), "home": str(home)}
    for program in programs:
        log = str(home / f"{program.name}.log")
        state.components[program.name] = Component(pid=0, url=urls[program.name], log=log)
    state.save(state_file())
    say(f"supervisor (supervisord, pid {state.supervisor['pid']})")

    _start(sup, state, "postgres")
    pg.ensure_databases(int(urls["postgres"].rsplit(":", 1)[1]))
    say(f"PostgreSQL on {urls['postgres']} (data in {pg.data})")
    _start(sup, state, "s3")
    say(f"S3 (SeaweedFS) on {urls['s3']}, bucket {BUCKET}")
    sup.start("mlflow")
    sup.start("prefect")
    _start(sup, state, "mlflow", 180)
    say(f"MLflow server on {urls['mlflow']}")
    _start(sup, state, "prefect", 180)
    say(f"Prefect server on {urls['prefect']}")
    if ray:
        _start(sup, state, "ray", 120)
        yield_cpu_to_workers([state.components["ray"].pid], settings.ray_daemon_niceness)
        say(f"Ray head on {urls['ray']} ({gpus} GPUs)")
    state.save(state_file())
    _apply_infra(state, deploy)
    say("work pool, queues, gpu limit, resume automation" + (", deployments" if deploy else ""))
    _start(sup, state, "worker")
    time.sleep(1.0)
    if sup.processes()["worker"]["statename"] != "RUNNING":
        raise RuntimeError(f"the Prefect worker exited at once; see {home / 'worker.log'}")
    say(f"worker on pool {_pool_name(state)}")
    _start(sup, state, "resumer")
    say("job resumer")
    if ray:
        _start(sup, state, "tinker", 120)
        say(f"Tinker API on {state.env['TINKER_BASE_URL']}")
    _start(sup, state, "openai", 120)
    say(f"OpenAI-compatible endpoint on {state.env['OPENAI_BASE_URL']}")
    state.save(state_file())


def _start(sup: Supervisor, state: StackState, name: str, timeout: float = 60.0) -> None:
    """Start ``name`` (if it is not already starting) and wait until it answers; its pid goes
    into the state."""
    sup.start(name)
    comp = state.components[name]
    deadline = time.monotonic() + timeout
    url = _health_url(name, comp.url)
    while True:
        info = sup.processes()[name]
        if info["statename"] in ("FATAL", "BACKOFF"):
            raise RuntimeError(f"the {WHAT[name]} did not start; see {comp.log}")
        if info["statename"] == "RUNNING":
            comp.pid = int(info["pid"])
            if url is None and name not in ("postgres", "ray"):
                return
            if healthy(url or f"tcp://{comp.url}"):  # postgres, ray: their port
                return
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"the {WHAT[name]} did not answer within {timeout:.0f} s; see {comp.log}"
            )
        time.sleep(0.2)


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
    """supervisord stops every component, then itself; anything a component left behind (a
    stack made before supervision, or a supervisor that was killed) is stopped by PID."""
    sup = state.supervisord()
    if sup is not None:
        sup.shutdown(int(state.supervisor["pid"]))
    for name in START_ORDER[::-1]:
        comp = state.components.get(name)
        if comp is not None and comp.pid:
            _stop_group(name, comp.pid)


def _stop_group(name: str, pid: int, timeout: float = 20.0) -> None:
    """SIGINT (the worker; the Ray head, which `ray start --block` ignores SIGTERM for) or
    SIGTERM to the component's process group; SIGKILL if it lingers."""
    import signal

    sig = signal.SIGINT if name in ("worker", "ray", "postgres") else signal.SIGTERM
    for s in (sig, signal.SIGKILL):
        try:
            os.killpg(pid, s)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not _alive(pid):
                return
            time.sleep(0.2)


def stack_down(path: Path | None = None) -> list[str]:
    """Stop what the state file lists (default: the one under ``FLOWRL_HOME``), worker first;
    remove the state file and the pointer to it. The data (database, S3) stays."""
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
