"""Starting the environment service for a test: ``python -m flowrl.environments.service`` on a
free loopback port, as an operator would; the caller stops it by PID."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from flowrl.infra.servers import free_port, wait_for_http

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
        [sys.executable, "-m", "flowrl.environments.service", "--port", str(port), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    wait_for_http(f"{url}/health", timeout=60, process=proc)
    return url, proc
