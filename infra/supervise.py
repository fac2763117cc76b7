"""The stack's supervisor: supervisord runs every component and restarts one that exits; a
health listener of flowrl's restarts one that stops answering.

- ``Supervisor`` writes ``<stack>/supervisord.conf`` (one ``[program:…]`` per component, none
  started by supervisord itself: ``stack up`` starts them in order and waits for each) and each
  component's command and environment in ``<stack>/programs/<name>.json`` (mode 0600: the
  environment holds passwords, which therefore appear in no config and on no command line).
- Every program runs through ``python -m flowrl.infra.supervise launch``, which first stops what
  is left of the component's previous instance (processes carrying its marker variable, e.g.
  the server children of a SIGKILLed ``mlflow server`` that still hold its port), drops root for
  a component that must not run as root, then execs the command: a restart gets the same port
  and the same data. The worker is the exception: what is left of it are flow runs, which go on.
- ``python -m flowrl.infra.supervise watch`` is supervisord's event listener: it keeps, per
  component, the restarts and the last reason in ``<stack>/supervision.json``, and on a
  five-second tick asks each running component's health URL; one that has not answered for
  ``UNHEALTHY_S`` seconds (after its start-up grace) is killed, and supervisord restarts it.

Only the standard library is imported at the top: the launcher starts every component.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path

MARKER = "FLOWRL_STACK_COMPONENT"
"""Set in every process of a component (``<stack dir>/<name>``): what a restart cleans up."""
RECORD = "supervision.json"
UNHEALTHY_S = 60.0
PROBE_TIMEOUT_S = 5.0
_open = urllib.request.build_opener(urllib.request.ProxyHandler({})).open


@dataclass
class Program:
    """One component as supervisord runs it."""

    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    health: str | None = None
    """``http://…`` (any HTTP answer is health) or ``tcp://host:port``; None: the process only."""
    user: str | None = None
    """Run as this system user (the stack runs as root and the program must not)."""
    reach: list[str] = field(default_factory=list)
    """Folders ``user`` must reach: before each start the search bit (not read) is set on each
    and every folder above it (anything may have taken it away meanwhile, as pytest does to
    its temp root at each session's start)."""
    stop_signal: str = "TERM"
    stop_wait_s: int = 20
    grace_s: float = 180.0
    """Seconds after a (re)start before a failing health check counts (cold starts)."""
    clean_previous: bool = True
    """Before a restart, kill what is left of the previous instance (False for the worker,
    whose leftovers are flow runs)."""


class Supervisor:
    """supervisord for the stack in ``home`` (``<FLOWRL_HOME>/stack``)."""

    def __init__(self, home: Path, socket_path: Path):
        self.home = home
        self.socket_path = socket_path

    @property
    def config(self) -> Path:
        return self.home / "supervisord.conf"

    def write(self, programs: list[Program]) -> None:
        """The config and each program's spec (the order of ``programs`` is the stop order's
        reverse: supervisord stops higher priorities first)."""
        folder = self.home / "programs"
        folder.mkdir(parents=True, exist_ok=True)
        folder.chmod(0o700)
        for program in programs:
            path = folder / f"{program.name}.json"
            path.touch(mode=0o600)
            path.write_text(json.dumps(asdict(program)))
        self.config.write_text(self._config_text(programs))

    def _config_text(self, programs: list[Program]) -> str:
        def q(value: object) -> str:  # supervisord expands %(...)s in values
            return str(value).replace("%", "%%")

        home, python = self.home, sys.executable
        lines = [
            "[unix_http_server]",
            f"file={q(self.socket_path)}",
            "chmod=0700",
            "[supervisord]",
            "nodaemon=true",
            f"logfile={q(home / 'supervisord.log')}",
            f"pidfile={q(home / 'supervisord.pid')}",
            f"childlogdir={q(home)}",
            "identifier=flowrl-stack",
            "[rpcinterface:supervisor]",
            "supervisor.rpcinterface_factory = supervisor.rpcinterface:make_main_rpcinterface",
            "[supervisorctl]",
            f"serverurl=unix://{q(self.socket_path)}",
        ]
        for priority, p in enumerate(programs, start=10):
            launcher = [python, "-m", "flowrl.infra.supervise", "launch", str(home), p.name]
            lines += [
                f"[program:{p.name}]",
                f"command={q(shlex.join(launcher))}",
                f"directory={q(Path(__file__).resolve().parent.parent)}",
                "autostart=false",
                "autorestart=true",
                "startsecs=1",
                "startretries=100000",
                f"stopsignal={p.stop_signal}",
                f"stopwaitsecs={p.stop_wait_s}",
                "stopasgroup=true",
                "killasgroup=true",
                "redirect_stderr=true",
                f"stdout_logfile={q(home / f'{p.name}.log')}",
                "stdout_logfile_maxbytes=50MB",
                "stdout_logfile_backups=1",
                f"priority={priority}",
            ]
        watcher = [python, "-m", "flowrl.infra.supervise", "watch", str(home)]
        lines += [
            "[eventlistener:health]",
            f"command={q(shlex.join(watcher))}",
            "events=PROCESS_STATE,TICK_5",
            "autostart=true",
            "autorestart=true",
            "stdout_logfile=NONE",  # its stdout is supervisord's event protocol
            f"stderr_logfile={q(home / 'health.log')}",
            "buffer_size=100",
            "priority=1",
        ]
        return "\n".join(lines) + "\n"

    # ------------------------------------------------------------------ the daemon

    def start_daemon(self, drop_env: tuple[str, ...] = ()) -> int:
        """supervisord in the foreground of a process group of its own, in this process's
        environment less ``drop_env`` (a client's variables for an earlier stack: each program
        gets its own); returns its pid once its socket answers."""
        binary = Path(sys.executable).with_name("supervisord")
        if not binary.exists():
            from flowrl.infra.servers import MissingComponentError

            raise MissingComponentError(
                "the stack's supervisor is not installed (the supervisor package, `supervisord`); "
                "install flowrl's dependencies with `make setup`"
            )
        self.socket_path.unlink(missing_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in drop_env}
        with open(self.home / "supervisord.out", "ab") as out:
            proc = subprocess.Popen(
                [str(binary), "-n", "-c", str(self.config)],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        deadline = time.monotonic() + 30
        while not self.answers():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"supervisord did not start; see {self.home / 'supervisord.log'}"
                )
            time.sleep(0.1)
        return proc.pid

    def rpc(self):  # -> the ``supervisor`` namespace of supervisord's XML-RPC API
        import xmlrpc.client

        from supervisor.xmlrpc import SupervisorTransport

        transport = SupervisorTransport(None, None, f"unix://{self.socket_path}")
        return xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport).supervisor

    def answers(self) -> bool:
        try:
            return self.rpc().getState()["statename"] == "RUNNING"
        except (OSError, Exception):  # no socket, refused, or supervisord shutting down
            return False

    def start(self, name: str) -> None:
        """Start ``name`` unless it is running or starting (no wait: the caller waits for its
        health)."""
        import xmlrpc.client

        try:
            self.rpc().startProcess(name, False)
        except xmlrpc.client.Fault as fault:
            if "ALREADY_STARTED" not in fault.faultString:
                raise

    def processes(self) -> dict[str, dict]:
        """supervisord's view of each program: ``statename``, ``pid``, ``start``, ..."""
        return {p["name"]: p for p in self.rpc().getAllProcessInfo() if p["group"] != "health"}

    def shutdown(self, pid: int, timeout: float = 60.0) -> None:
        """Stop every program (supervisord: highest priority first, each with its stop signal,
        its group killed after its wait) and supervisord itself."""
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and alive(pid):
            time.sleep(0.2)
        if alive(pid):
            os.killpg(pid, signal.SIGKILL)


def read_record(home: Path) -> dict[str, dict]:
    """Per component: ``restarts``, ``last_reason``, ``last_at`` (as the listener wrote them)."""
    try:
        return json.loads((home / RECORD).read_text())
    except (OSError, ValueError):
        return {}


def alive(pid: int) -> bool:
    """The process ``pid`` exists (reaped first if it is this process's exited child)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    return True


# ---------------------------------------------------------------------------- the launcher


def searchable_to_all(path: Path) -> None:
    """Give ``path`` and every folder above it the search bit for others (not read)."""
    import stat

    for folder in (path, *path.parents):
        mode = folder.stat().st_mode
        if not mode & stat.S_IXOTH:
            folder.chmod(mode | stat.S_IXOTH)


def _leftovers(marker: str) -> list[int]:
    """PIDs of processes (other than this one) whose environment carries ``marker``."""
    own = os.getpid()
    needle = f"{MARKER}={marker}\0".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == own:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    found.append(int(entry))
        except OSError:
            continue
    return found


def launch(home: Path, name: str) -> None:
    """Exec the program ``name`` of the stack in ``home`` (supervisord's command for it)."""
    spec = Program(**json.loads((home / "programs" / f"{name}.json").read_text()))
    marker = f"{home}/{name}"
    if spec.clean_previous:
        leftovers = _leftovers(marker)
        for pid in leftovers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if leftovers:
            print(f"flowrl: killed {len(leftovers)} leftover processes of {name}", flush=True)
            time.sleep(0.5)  # the kernel frees their ports
    env = {**os.environ, **spec.env, MARKER: marker}
    if spec.user is not None and os.geteuid() == 0:
        import pwd

        for folder in spec.reach:
            searchable_to_all(Path(folder))
        entry = pwd.getpwnam(spec.user)
        os.initgroups(spec.user, entry.pw_gid)
        os.setgid(entry.pw_gid)
        os.setuid(entry.pw_uid)
        env |= {"HOME": entry.pw_dir, "USER": spec.user, "LOGNAME": spec.user}
    os.execvpe(spec.command[0], spec.command, env)


# ---------------------------------------------------------------------------- the listener


class _Watch:
    """State of the health listener: what supervisord said of each program, and its record."""

    def __init__(self, home: Path):
        self.home = home
        self.programs = {
            p.stem: Program(**json.loads(p.read_text())) for p in (home / "programs").glob("*.json")
        }
        self.record = read_record(home)
        self.running: dict[str, tuple[int, float]] = {}  # name -> (pid, since)
        self.failing: dict[str, float] = {}  # name -> first failed probe
        self.killed: dict[str, str] = {}  # name -> why the listener killed it
        self.pool = ThreadPoolExecutor(max_workers=8)

    def note(self, name: str, reason: str | None = None, restart: bool = False) -> None:
        entry = self.record.setdefault(name, {"restarts": 0, "last_reason": None, "last_at": None})
        if restart:
            entry["restarts"] += 1
        if reason is not None:
            entry["last_reason"] = reason
            entry["last_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.save()

    def save(self) -> None:
        tmp = self.home / f".{RECORD}.tmp"
        tmp.write_text(json.dumps(self.record, indent=2))
        tmp.replace(self.home / RECORD)

    def on_state(self, event: str, fields: dict[str, str]) -> None:
        name = fields.get("processname", "")
        if name not in self.programs:
            return
        if event == "PROCESS_STATE_RUNNING":
            self.running[name] = (int(fields["pid"]), time.monotonic())
            self.failing.pop(name, None)
            return
        self.running.pop(name, None)
        if event == "PROCESS_STATE_EXITED" and fields.get("expected") == "0":
            reason = self.killed.pop(name, None)
            self.note(name, reason or _exit_reason(self.home, name, fields.get("pid", "?")))
        elif event == "PROCESS_STATE_BACKOFF":
            self.note(name, f"exited while starting; see {self.home / (name + '.log')}")
        elif event == "PROCESS_STATE_FATAL":
            self.note(name, "supervisord gave up restarting it")
        elif event == "PROCESS_STATE_STARTING":
            if fields.get("from_state") in ("BACKOFF", "EXITED"):  # supervisord's own restart
                self.note(name, restart=True)

    def on_tick(self) -> None:
        now = time.monotonic()
        due = {
            name: self.programs[name].health
            for name, (_, since) in self.running.items()
            if self.programs[name].health and now - since >= self.programs[name].grace_s
        }
        answers = dict(zip(due, self.pool.map(healthy, due.values()), strict=True))
        for name, ok in answers.items():
            if ok:
                self.failing.pop(name, None)
                continue
            first = self.failing.setdefault(name, now)
            if now - first >= UNHEALTHY_S and name in self.running:
                pid = self.running.pop(name)[0]
                self.failing.pop(name, None)
                self.killed[name] = f"health check unanswered for {UNHEALTHY_S:.0f} s; killed"
                try:
                    os.killpg(pid, signal.SIGKILL)  # supervisord restarts it
                except ProcessLookupError:
                    pass


def healthy(target: str) -> bool:
    """``target`` answers: ``tcp://host:port`` accepts a connection, an ``http://`` URL gives any
    HTTP answer (an error status included)."""
    if target.startswith("tcp://"):
        host, _, port = target.removeprefix("tcp://").rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S):
                return True
        except OSError:
            return False
    try:
        with _open(target, timeout=PROBE_TIMEOUT_S):
            return True
    except urllib.error.HTTPError:
        return True  # an HTTP error status is still an answer
    except OSError:
        return False


def _exit_reason(home: Path, name: str, pid: str) -> str:
    """supervisord's own words for the exit (``terminated by SIGKILL``, ``exit status 1``)."""
    try:
        with open(home / "supervisord.log", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            tail = f.read().decode(errors="replace").splitlines()
    except OSError:
        tail = []
    for line in reversed(tail):
        if f"exited: {name} " in line:
            return line.split(f"exited: {name} ", 1)[1].strip("() ").split(";")[0]
    return f"exited (pid {pid})"


def watch(home: Path) -> None:
    """supervisord's event-listener protocol on stdin/stdout, forever."""
    state = _Watch(home)
    for name in state.programs:
        state.record.setdefault(name, {"restarts": 0, "last_reason": None, "last_at": None})
    state.save()
    while True:
        sys.stdout.write("READY\n")
        sys.stdout.flush()
        header = dict(token.split(":", 1) for token in sys.stdin.readline().split())
        payload = sys.stdin.read(int(header["len"]))
        event = header.get("eventname", "")
        try:
            if event.startswith("PROCESS_STATE"):
                first_line = payload.split("\n", 1)[0]
                state.on_state(event, dict(t.split(":", 1) for t in first_line.split()))
            elif event.startswith("TICK"):
                state.on_tick()
        except Exception as err:  # the listener must answer every event
            print(f"flowrl health listener: {event}: {err!r}", file=sys.stderr, flush=True)
        sys.stdout.write("RESULT 2\nOK")
        sys.stdout.flush()


def main(argv: list[str]) -> None:
    if len(argv) >= 3 and argv[0] == "launch":
        launch(Path(argv[1]), argv[2])
    elif len(argv) >= 2 and argv[0] == "watch":
        watch(Path(argv[1]))
    else:
        raise SystemExit("usage: python -m flowrl.infra.supervise launch HOME NAME | watch HOME")


if __name__ == "__main__":
    main(sys.argv[1:])
