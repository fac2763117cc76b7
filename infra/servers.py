"""Loopback servers run as child processes and managed by PID, for the local stack and tests.

`MotoServer` runs moto's S3-compatible HTTP endpoint. moto keeps all state in memory, so
`stop()` + `start()` loses every object; `start()` re-creates the buckets made through
`create_bucket` so that writes succeed again after a restart. To simulate an outage that keeps
the data, use `pause()` / `resume()` (SIGSTOP / SIGCONT): the port stays bound and connections
are accepted by the kernel but never answered, so clients hit their read timeouts.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

# Loopback only: never route through an HTTP(S)_PROXY from the environment.
_open = urllib.request.build_opener(urllib.request.ProxyHandler({})).open

TEST_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class MissingComponentError(RuntimeError):
    """A program the local stack runs is not installed; the message names the command that
    installs it."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (the usual bind-to-0 trick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def wait_for_http(url: str, timeout: float = 30.0, process: subprocess.Popen | None = None) -> None:
    """Block until `url` answers any HTTP status; fail fast if `process` exits first."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"server process exited with {process.returncode} before {url}")
        try:
            with _open(url, timeout=1.0):
                return
        except urllib.error.HTTPError:
            return  # an HTTP error status is still an answer
        except OSError as error:
            last_error = error
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout} s (last error: {last_error})")


def _moto_command() -> list[str]:
    script = Path(sys.executable).with_name("moto_server")
    if script.exists():
        return [str(script)]
    found = shutil.which("moto_server")
    return [found] if found else [sys.executable, "-m", "moto.server"]


class MotoServer:
    """moto's S3 endpoint on 127.0.0.1, as a context manager; restarts keep the same port."""

    def __init__(
        self, port: int | None = None, log_dir: str | None = None, start_timeout: float = 30.0
    ) -> None:
        self.host = "127.0.0.1"
        self.port = port or free_port(self.host)
        self.start_timeout = start_timeout
        self.log_path = Path(log_dir or tempfile.mkdtemp(prefix="moto-")) / "moto_server.log"
        self.buckets: list[str] = []
        self._process: subprocess.Popen | None = None
        self._paused = False

    @property
    def endpoint_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def env(self) -> dict[str, str]:
        """Environment variables an S3 client (s3fs, boto3, MLflow) needs to use this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint_url, **TEST_CREDENTIALS}

    def start(self) -> MotoServer:
        """Start the server (again) on the same port; re-create buckets made by `create_bucket`."""
        if self.running:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                [*_moto_command(), "-H", self.host, "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self._paused = False
        try:
            wait_for_http(f"{self.endpoint_url}/moto-api/", self.start_timeout, self._process)
        except Exception:
            self.stop()
            raise
        for name in self.buckets:
            self._request("PUT", f"/{name}")
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate by PID, wait, kill if it does not exit. Loses all stored objects."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        if self._paused:
            os.kill(process.pid, signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            self._paused = False
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): requests hang until `resume()`; state is kept."""
        if self.running and not self._paused:
            os.kill(self._process.pid, signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """Continue a paused server (SIGCONT)."""
        if self.running and self._paused:
            os.kill(self._process.pid, signal.SIGCONT)
            self._paused = False

    def create_bucket(self, name: str) -> None:
        """Create a bucket (remembered, and re-created by `start()` after a restart)."""
        self._request("PUT", f"/{name}")
        if name not in self.buckets:
            self.buckets.append(name)

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API) and forget remembered buckets."""
        self._request("POST", "/moto-api/reset")
        self.buckets.clear()

    def _request(self, method: str, path: str) -> None:
        request = urllib.request.Request(self.endpoint_url + path, method=method)
        with _open(request, timeout=10.0):
            pass

    def __enter__(self) -> MotoServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()
