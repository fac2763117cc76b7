"""Shared fixtures. Servers run on loopback as child processes and are stopped by PID."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from infra.servers import MotoServer

# Applied when this file is imported, i.e. before any test module is collected: torch, Ray and
# Prefect read these at import time, so an autouse fixture would come too late.
QUIET_TEST_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
os.environ.update(QUIET_TEST_ENV)


# ---------------------------------------------------------------------------- S3 (moto)

TEST_BUCKET = "flowrl-test"


@dataclass
class MotoS3:
    """What a test needs to talk to the moto S3 endpoint."""

    server: MotoServer
    bucket: str

    @property
    def endpoint_url(self) -> str:
        return self.server.endpoint_url

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}"


@pytest.fixture(scope="session")
def moto_server() -> Iterator[MotoServer]:
    """One moto process for the whole session (~0.3-0.6 s to start); use `moto_s3` in tests."""
    with MotoServer() as server:
        yield server


@pytest.fixture
def moto_s3(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[MotoS3]:
    """An empty bucket `flowrl-test` on moto, with AWS_* env vars set for this test only.

    State is wiped per test (moto's reset API); a test may pause, stop or restart the server,
    and it is running and resumed again afterwards.
    """
    moto_server.start()  # no-op if running; restarts it if a previous test stopped it
    moto_server.reset()
    moto_server.create_bucket(TEST_BUCKET)
    for name, value in moto_server.env().items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN"):  # a developer's real credentials
        monkeypatch.delenv(name, raising=False)
    yield MotoS3(server=moto_server, bucket=TEST_BUCKET)
    moto_server.resume()
    moto_server.start()


# ------------------------------------------------------------- Prefect API and flowrl home


@pytest.fixture(scope="session")
def prefect_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A real (temporary) Prefect API server for the whole session, with its own PREFECT_HOME."""
    os.environ["PREFECT_HOME"] = str(tmp_path_factory.mktemp("prefect-home"))
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def flowrl_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """FLOWRL_HOME for the session: embedded MLflow (SQLite) and storage under a temp folder."""
    home = tmp_path_factory.mktemp("flowrl-home")
    saved = {k: os.environ.get(k) for k in ("FLOWRL_HOME", "MLFLOW_TRACKING_URI")}
    os.environ["FLOWRL_HOME"] = str(home)
    os.environ.pop("MLFLOW_TRACKING_URI", None)
    yield home
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
