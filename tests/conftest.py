"""Shared fixtures. Servers run on loopback as child processes and are stopped by PID."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from flowrl.infra.servers import MotoServer

# Applied when this file is imported, i.e. before any test module is collected: torch, Ray and
# Prefect read these at import time, so an autouse fixture would come too late.
QUIET_TEST_ENV = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
os.environ.update(QUIET_TEST_ENV)

# Closer math paths on x86-64 CPUs: ATen's vectorised kernels, MKL's BLAS (conditional numerical
# reproducibility) and oneDNN all capped at AVX2, so an AVX-512 Xeon and an AVX2-only EPYC take
# the same kernels. This does not make a trajectory identical across the two (measured
# 2026-11-28: the same seeds gave the Xeon other rewards, pinned as native), so each learning
# test's bar is one both machines meet, pinned and native. Every process the suite starts
# inherits them: jobs, Ray workers (also via their runtime_env), notebook kernels.
# ``FLOWRL_TEST_KERNELS=native`` leaves the CPU's own kernels (to check that the learning tests
# hold unpinned too); a variable the developer set wins.
PINNED_KERNELS_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_CBWR": "AVX2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
}
if os.environ.get("FLOWRL_TEST_KERNELS", "pinned") != "native":
    for _name, _value in PINNED_KERNELS_ENV.items():
        os.environ.setdefault(_name, _value)

# Two xdist workers share this machine's cores, so each job's workers get one thread
# (``resources.torch_threads: auto`` would otherwise give every job all of them): what an operator
# sets where jobs share a machine. Tests of the auto rule set their own.
os.environ.setdefault("FLOWRL_CPU_THREADS", "1")

# One model cache for the whole run, as a machine has (like HF_HOME): every test's home, job
# subprocess and xdist worker shares it, so each tiny model shape is built once per run, not
# once per test home. Made by the first process to import this file (xdist's controller; its
# workers inherit it) and removed by it at the end. A developer's own FLOWRL_MODEL_CACHE wins.
_OWN_MODEL_CACHE = None
if "FLOWRL_MODEL_CACHE" not in os.environ:
    _OWN_MODEL_CACHE = tempfile.mkdtemp(prefix="flowrl-model-cache-")
    os.environ["FLOWRL_MODEL_CACHE"] = _OWN_MODEL_CACHE

# `flowrl stack up` writes a pointer to its stack in the user's config folder: the suite's
# stacks write theirs in a temp folder of the run, never in the developer's ~/.config.
# Each xdist worker has a folder of its own in it: a stack another worker started must not
# take the pointer that this worker's `flowrl stack status` follows.
_OWN_CONFIG_DIR = None
if "FLOWRL_CONFIG_DIR" not in os.environ:
    _OWN_CONFIG_DIR = tempfile.mkdtemp(prefix="flowrl-config-")
    os.environ["FLOWRL_CONFIG_DIR"] = _OWN_CONFIG_DIR
    os.environ["FLOWRL_TEST_CONFIG_ROOT"] = _OWN_CONFIG_DIR
if os.environ.get("PYTEST_XDIST_WORKER") and os.environ.get("FLOWRL_TEST_CONFIG_ROOT"):
    os.environ["FLOWRL_CONFIG_DIR"] = os.path.join(
        os.environ["FLOWRL_TEST_CONFIG_ROOT"], os.environ["PYTEST_XDIST_WORKER"]
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    for own in (_OWN_MODEL_CACHE, _OWN_CONFIG_DIR):
        if own is not None:
            shutil.rmtree(own, ignore_errors=True)


# ------------------------------------------------------------------ order under pytest-xdist

# `make test` runs the suite on pytest-xdist workers, one test module per worker at a time
# (`--dist loadfile --no-loadscope-reorder`). Modules start longest first (serial seconds at
# the last measurement), so no long module is left to run alone at the end.
SLOW_MODULES = (
    "test_stack.py",  # ~600 s: the whole local stack, lease expiry, load test, then its faults
    "test_deployments.py",  # ~370 s: every deployment through the worker, its own stack
    "test_plugins.py",  # ~400 s: six `flowrl train` runs of a user's environment, the README
    "test_ui.py",  # ~250 s: the README's stack commands (a 150-step job), then both UIs in Chromium
    "test_model_families.py",  # ~230 s: six RL jobs of three model families, local and S3
    "test_flow_e2e.py",  # ~180 s: an 80-step RL job
    "test_resume_kill.py",  # ~130 s: two training processes
    "test_flow_s3.py",  # ~115 s: a 20 s S3 outage mid-checkpoint
    "test_games.py",  # ~140 s: the README's Nim game through `flowrl selfplay`
    "test_lifecycle.py",  # ~100 s: a job of every kind
    "test_retrain.py",  # ~80 s
    "test_selfplay_resume.py",  # ~70-100 s: a self-play job killed and resumed
    "test_env_timeouts.py",  # ~80 s: hung environments in every mode, one job
    "test_layering.py",  # ~60 s: a wheel build and a job in a user folder
    "test_namespaces.py",  # ~60 s: two namespaces' jobs at once, storage on S3
    "test_samplers.py",  # ~75 s: two samplers on a two-node Ray cluster
    "test_sft.py",  # ~50 s
    "test_tokenizer_compat.py",  # ~45 s: installs transformers 4.x into a temp folder
    "test_mlflow_model.py",  # ~30 s: mlflow models serve
    "test_selfplay_flow.py",
    "test_inference.py",
    "test_off_policy_flow.py",
    "test_notebooks.py",
    "test_geometry_flow.py",
    "test_workers.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOW_MODULES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable within a module


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """With ``FLOWRL_TEST_TIMELINE=<folder>``: one line per test (worker, start, end, test id)
    in ``<folder>/<worker>.tsv``, to see how the modules pack onto the xdist workers."""
    folder = os.environ.get("FLOWRL_TEST_TIMELINE")
    start = time.time()
    yield
    if folder:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{worker}.tsv"), "a") as f:
            f.write(f"{worker}\t{start:.2f}\t{time.time():.2f}\t{item.nodeid}\n")


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
def ray_local() -> Iterator[None]:
    """One private local Ray for the whole session (8 logical CPUs, 2 logical GPUs): every flow
    run in this process finds it initialised and uses it (prefect-ray starts and stops none),
    and tests that need Ray directly share it. Kill and fault tests run their jobs in
    subprocesses with a Ray of their own."""
    import ray

    from flowrl.infra.ray_auth import ensure_token

    ensure_token()  # made once: a fresh machine's first clusters, started at once, share it
    # address="local": always a fresh private instance, never another user's running cluster.
    ray.init(
        address="local",
        num_cpus=8,
        num_gpus=2,
        include_dashboard=False,
        namespace="flowrl",
        log_to_driver=False,
        _system_config={"prestart_worker_first_driver": False},  # as a job's own local Ray
    )
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def flowrl_home(tmp_path_factory: pytest.TempPathFactory, ray_local: None) -> Iterator:
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


# ------------------------------------------------------------------------ the local stack

LOAD_TEST_SCHEDULER = """
pool: {name: flowrl-test-pool, type: process, concurrency_limit: 2, gpus: 2}
gpu_limit: gpu
gpu_lease_seconds: 60
queues:
  - {name: hi, priority: 1, concurrency_limit: 2}
  - {name: lo, priority: 2, concurrency_limit: 1}
"""


@pytest.fixture(scope="session")
def local_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """``flowrl stack up`` for the session (PostgreSQL, S3, MLflow, Prefect server, Ray head,
    worker, the Tinker and OpenAI services, under supervisord)
    on a small scheduler declaration: pool limit 2, queues hi (2, priority 1) and lo (1,
    priority 2), 2 GPU slots. Deployments are made by the tests that need them. Yields the
    ``StackState``; stopped by PID at the end (worker first)."""
    from flowrl.infra import stack

    home = tmp_path_factory.mktemp("stack-home")
    declaration = home / "scheduler.yaml"
    declaration.write_text(LOAD_TEST_SCHEDULER)
    keys = ("FLOWRL_HOME", "FLOWRL_SCHEDULER_FILE", "PREFECT_API_URL")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update({"FLOWRL_HOME": str(home), "FLOWRL_SCHEDULER_FILE": str(declaration)})
    os.environ.pop("PREFECT_API_URL", None)
    try:
        state = stack.stack_up(gpus=2, deploy=False, ray=True)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    yield state
    os.environ["FLOWRL_HOME"] = str(home)
    try:
        stack.stack_down()
    finally:
        if saved["FLOWRL_HOME"] is None:
            os.environ.pop("FLOWRL_HOME", None)
        else:
            os.environ["FLOWRL_HOME"] = saved["FLOWRL_HOME"]


@pytest.fixture
def stack_env(local_stack, monkeypatch: pytest.MonkeyPatch) -> Iterator:
    """This test talks to the local stack: its env vars and Prefect API URL."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    for key, value in local_stack.env.items():
        monkeypatch.setenv(key, value)
    with temporary_settings(updates={PREFECT_API_URL: local_stack.env["PREFECT_API_URL"]}):
        yield local_stack


# ------------------------------------------------------------------ a tiny model and prompts


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The default tiny Llama (random weights, local tokenizer) in a module's temp folder."""
    from flowrl.backends.models.tiny_model import TinyModelSpec, build_tiny_model

    return build_tiny_model(TinyModelSpec(), str(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def prompts(model_dir: str) -> list[list[int]]:
    """Chat prompts of three different lengths (the sampler must left-pad them)."""
    from flowrl.backends.models.chat import HFChatFormat
    from flowrl.backends.models.model_folder import load_tokenizer

    chat = HFChatFormat(load_tokenizer(model_dir))
    questions = ["1+1?", "What is 12 * 13? Think step by step.", "Hi"]
    encoded = [chat.encode_prompt([{"role": "user", "content": q}]) for q in questions]
    assert len({len(p) for p in encoded}) == 3
    return encoded
