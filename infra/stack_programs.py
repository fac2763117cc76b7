"""What each component of the local stack runs: its command, environment, health check and
address (``infra/stack.py`` starts them under supervisord, in this order, and keeps what a
client needs in the stack's state).

- ``postgres``: the stack's PostgreSQL (``infra/postgres.py``), TCP on 127.0.0.1 only;
- ``s3``: SeaweedFS, objects on disk (``infra/objectstore.py``);
- ``mlflow``: an MLflow tracking server on PostgreSQL, artifacts proxied to S3;
- ``prefect``: a Prefect server on PostgreSQL;
- ``ray``: a Ray head (token auth, with the stack's own token);
- ``worker``: a Prefect process worker on the scheduler's pool;
- ``resumer``: the crashed jobs the automations missed (``infra/resumer.py``);
- ``tinker`` (with Ray) and ``openai``: flowrl's services, on loopback unless keys are set.

Every address is a free port of 127.0.0.1, picked at each ``stack up``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from flowrl.infra import objectstore
from flowrl.infra.niceness import RAY_SYSTEM_CONFIG
from flowrl.infra.postgres import Postgres
from flowrl.infra.ray_auth import write_token_once
from flowrl.infra.scheduler import HEARTBEAT_SECONDS
from flowrl.infra.servers import TEST_CREDENTIALS, free_port
from flowrl.infra.settings import get_settings
from flowrl.infra.supervise import Program

HOST = "127.0.0.1"
BUCKET = "flowrl"
BIN = Path(sys.executable).parent
REPOSSESSOR_LOOP_SECONDS = 5
WORKER_QUERY_SECONDS = 1  # Prefect's default of 10 s would dominate submission -> start
# Flow runs started by the stack's worker send no task-run INFO lines to the API (one "Finished
# in state Completed()" per stage and step drowned the flow's own lines); task-run warnings and
# errors still go, and the flow-run logger stays at INFO. Prefect reads any key of its
# logging.yml from PREFECT_LOGGING_<PATH>_<TO>_<KEY>.
PREFECT_DB_VARIABLE = "FLOWRL_STACK_PREFECT_DB"
"""Set to ``sqlite``: the Prefect server on SQLite in the stack's folder, for comparison
(``benchmarks/database.py``); the stack's database is PostgreSQL."""
TASK_RUN_LOG_LEVEL = {"PREFECT_LOGGING_LOGGERS_PREFECT_TASK_RUNS_LEVEL": "WARNING"}


@dataclass
class Layout:
    """The stack's programs in start order, each one's address (``urls``) and the environment
    a client of the stack needs (``env``)."""

    programs: list[Program] = field(default_factory=list)
    urls: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)

    def add(self, program: Program, url: str) -> None:
        self.programs.append(program)
        self.urls[program.name] = url


def layout(home: Path, pg: Postgres, gpus: int, ray: bool, pool: str) -> Layout:
    """Every program of a stack in ``home`` (``<FLOWRL_HOME>/stack``) on the cluster ``pg``,
    with ``gpus`` GPU slots, a Ray head if ``ray``, a worker on ``pool``."""
    settings = get_settings()
    out = Layout()
    pg_port = free_port()
    out.add(
        Program(
            "postgres",
            pg.command(pg_port),
            user=pg.user,
            reach=pg.reach,
            stop_signal="INT",
            health=f"tcp://{HOST}:{pg_port}",
            grace_s=30,
        ),
        f"{HOST}:{pg_port}",
    )
    s3 = _s3(out, home)
    mlflow_url = _mlflow(out, pg.url(pg_port, "mlflow", "psycopg"), s3)
    prefect_db = pg.url(pg_port, "prefect", "asyncpg")
    if os.environ.get(PREFECT_DB_VARIABLE) == "sqlite":  # a comparison only (benchmarks/)
        prefect_db = f"sqlite+aiosqlite:///{home / 'prefect' / 'prefect.db'}"
    prefect_url = _prefect(out, home, prefect_db)
    out.env = {
        **s3,
        "PREFECT_API_URL": prefect_url,
        "FLOWRL_PREFECT_API_URL": prefect_url,
        "FLOWRL_MLFLOW_TRACKING_URI": mlflow_url,
        "FLOWRL_STORAGE_URL": f"s3://{BUCKET}/storage",
        "FLOWRL_HOME": str(settings.resolved_home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "RAY_USAGE_STATS_ENABLED": "0",
        # MLflow's telemetry sets and unsets a variable of os.environ from its own thread: a
        # request iterating the environment meanwhile failed with a KeyError (a job FAILED).
        "MLFLOW_DISABLE_TELEMETRY": "true",
        # Admission matches placement: the pool's GPU slots are the GPUs the Ray head offers,
        # so a job asking for more is refused at submission instead of waiting forever.
        "FLOWRL_POOL_GPUS": str(gpus),
    }
    if settings.scheduler_file is not None:
        out.env["FLOWRL_SCHEDULER_FILE"] = str(settings.scheduler_file.resolve())
    if ray:
        _ray(out, home, gpus, settings.ray_num_cpus)
    _worker(out, home, pool, prefect_url)
    out.add(_resumer(prefect_url), prefect_url)
    if ray:
        _tinker(out, home)
    _openai(out)
    return out


def _s3(out: Layout, home: Path) -> dict[str, str]:
    """SeaweedFS; the environment an S3 client of it needs."""
    (home / "s3").mkdir(exist_ok=True)
    weed, s3_port = objectstore.command(home / "s3", BUCKET, HOST)
    s3_url = f"http://{HOST}:{s3_port}"
    s3 = {**TEST_CREDENTIALS}
    out.add(Program("s3", weed, env=dict(s3), health=f"{s3_url}/healthz", grace_s=30), s3_url)
    return {**s3, "AWS_ENDPOINT_URL": s3_url}


def _mlflow(out: Layout, database_url: str, s3: dict[str, str]) -> str:
    port = free_port()
    url = f"http://{HOST}:{port}"
    cmd = [str(BIN / "mlflow"), "server", "--host", HOST, "--port", str(port)]
    cmd += ["--workers", "1", "--artifacts-destination", f"s3://{BUCKET}/mlflow"]
    env = {
        **s3,
        # Read by `mlflow server` from its environment: the password stays off the command line.
        "MLFLOW_BACKEND_STORE_URI": database_url,
        "MLFLOW_S3_ENDPOINT_URL": s3["AWS_ENDPOINT_URL"],
        "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
    }
    out.add(Program("mlflow", cmd, env=env, health=f"{url}/health"), url)
    return url


def _prefect(out: Layout, home: Path, database_url: str) -> str:
    port = free_port()
    url = f"http://{HOST}:{port}/api"
    env = {
        "PREFECT_HOME": str(home / "prefect"),
        "PREFECT_API_DATABASE_CONNECTION_URL": database_url,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # The UI in a browser talks to this server's API, on whatever port it got.
        "PREFECT_SERVER_UI_API_URL": url,
        "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
        # Expired GPU-slot leases (a killed job's) are reclaimed every 5 s, not every 15 s.
        "PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": str(REPOSSESSOR_LOOP_SECONDS),
    }
    cmd = [str(BIN / "prefect"), "server", "start", "--host", HOST, "--port", str(port)]
    out.add(Program("prefect", cmd, env=env, health=f"{url}/health"), url)
    return url


def _ray(out: Layout, home: Path, gpus: int, num_cpus: int) -> None:
    # Ray 2.60's token auth, on: the head and every driver read the stack's own token
    # (made once, mode 0600, beside the state; not the user's ~/.ray/auth_token).
    token = home / "ray-auth-token"
    write_token_once(token)
    ray_auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    port = free_port()
    # A short temp dir: Ray's unix socket paths must stay under ~107 characters.
    ray_tmp = tempfile.mkdtemp(prefix="flowrl-ray-")
    cmd = [str(BIN / "ray"), "start", "--head", "--block", "--node-ip-address", HOST]
    cmd += ["--port", str(port), "--num-cpus", str(num_cpus)]
    cmd += ["--num-gpus", str(gpus), "--include-dashboard", "false"]
    cmd += ["--disable-usage-stats", "--temp-dir", ray_tmp]
    # Only the workers' niceness: the one-at-a-time worker start of a job's local Ray
    # (RAY_SYSTEM_CONFIG) is not the stack's until it has been through a chaos run that passes.
    stack_config = {"worker_niceness": RAY_SYSTEM_CONFIG["worker_niceness"]}
    cmd += ["--system-config", json.dumps(stack_config)]
    # `ray start --block` stops its processes on SIGINT (it ignores SIGTERM).
    program = Program(
        "ray",
        cmd,
        env={"RAY_USAGE_STATS_ENABLED": "0", **ray_auth},
        stop_signal="INT",
        health=f"tcp://{HOST}:{port}",
        grace_s=60,
    )
    out.add(program, f"{HOST}:{port}")
    out.env |= {"FLOWRL_RAY_ADDRESS": f"{HOST}:{port}", **ray_auth}


def _worker(out: Layout, home: Path, pool: str, prefect_url: str) -> None:
    cmd = [str(BIN / "prefect"), "worker", "start", "--pool", pool, "--type", "process"]
    env = {
        **out.env,
        "PREFECT_WORKER_QUERY_SECONDS": str(WORKER_QUERY_SECONDS),
        # Each flow run says it is alive; one that stops (its process died unreported) is
        # marked CRASHED by the zombie automation (infra/scheduler.py) and resumed.
        "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(HEARTBEAT_SECONDS),
        # Flow logs reach the Prefect API at INFO (the CLI quiets its own terminal); task-run
        # logs at WARNING.
        "PREFECT_LOGGING_LEVEL": "INFO",
        **TASK_RUN_LOG_LEVEL,
        "PREFECT_HOME": str(home / "worker-home"),
    }
    # SIGINT: the worker finishes its bookkeeping. A restarted worker leaves the flow runs of
    # the one before it running (they report to the API themselves).
    program = Program("worker", cmd, env=env, stop_signal="INT", clean_previous=False)
    out.add(program, prefect_url)


def _resumer(prefect_url: str) -> Program:
    """``infra/resumer.py``: the crashed jobs that the resume automation missed."""
    from flowrl.infra.scheduler import RESUME_TAG, load_scheduler

    cmd = [sys.executable, "-m", "flowrl.infra.resumer", "--api", prefect_url]
    cmd += ["--tag", RESUME_TAG, "--max-attempts", str(load_scheduler().max_attempts)]
    return Program("resumer", cmd)


def _tinker(out: Layout, home: Path) -> None:
    """The Tinker API (``flowrl serve tinker --placement sessions``): each training model a run
    of the ``tinker-session`` deployment; a journal in the stack's folder, so that a restarted
    service carries on its clients' loops. With ``FLOWRL_TINKER_KEYS`` set, those keys; else
    without keys, on loopback (any ``tml-`` key is accepted, every caller one namespace)."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    cmd = [str(BIN / "flowrl"), "serve", "tinker", "--placement", "sessions"]
    cmd += ["--host", HOST, "--port", str(port), "--journal", str(home / "tinker-journal")]
    if not os.environ.get("FLOWRL_TINKER_KEYS"):
        cmd.append("--insecure-loopback")
    out.env["TINKER_BASE_URL"] = url
    out.add(Program("tinker", cmd, env=dict(out.env), health=f"{url}/api/v1/healthz"), url)


def _openai(out: Layout) -> None:
    """The OpenAI-compatible endpoint (``flowrl serve openai``) on the stack's MLflow and
    storage: its registered versions, Tinker checkpoints and base models. With
    ``FLOWRL_OPENAI_KEYS`` set, those keys; else without keys, on loopback. It loads a model on
    its first request, so at rest it holds none."""
    port = free_port()
    url = f"http://{HOST}:{port}"
    cmd = [str(BIN / "flowrl"), "serve", "openai", "--host", HOST, "--port", str(port)]
    if not os.environ.get("FLOWRL_OPENAI_KEYS"):
        cmd.append("--insecure-loopback")
    out.env["OPENAI_BASE_URL"] = f"{url}/v1"
    out.add(Program("openai", cmd, env=dict(out.env), health=f"{url}/health"), url)
