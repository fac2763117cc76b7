"""A training process killed with SIGKILL mid-run, resubmitted with the same job name, resumes
from its last complete checkpoint on S3 (moto): earlier steps are not redone, and the job ends
with a registered model version. On-policy and asynchronous (``schedule.max_staleness: 4``,
rollouts of later steps in flight when it is killed)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
STEPS = 12
ARGS = [
    "name=kill-job",
    "warmup.enabled=false",
    f"schedule.steps={STEPS}",
    "schedule.checkpoint_every=2",
    "schedule.eval_every=100",
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "env.params.eval_size=20",
]


def start_job(command: str, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``python -m flowrl COMMAND --set a …`` in its own process group, output to ``log``."""
    cmd = [sys.executable, "-m", "flowrl", command]
    for a in args:
        cmd += ["--set", a]
    with open(log, "ab") as out:
        return subprocess.Popen(
            cmd, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def kill_after_checkpoint(
    job: subprocess.Popen, checkpointed: Callable[[], int | None], log: Path, at_least: int = 2
) -> int:
    """SIGKILL ``job``'s process group (no cleanup, no final checkpoint) once ``checkpointed()``
    (the step of its latest checkpoint, or None) reaches ``at_least``; returns that step."""
    deadline = time.monotonic() + 300
    killed_after = None
    while time.monotonic() < deadline and job.poll() is None:
        killed_after = checkpointed()
        if killed_after is not None and killed_after >= at_least:
            os.killpg(job.pid, signal.SIGKILL)
            break
        time.sleep(0.2)
    job.wait(30)
    assert job.returncode == -signal.SIGKILL, log.read_text()[-3000:]
    assert killed_after is not None
    return killed_after


def _train(env: dict[str, str], log: Path, extra: list[str] = ()) -> subprocess.Popen:
    return start_job("train", [*ARGS, *extra], env, log)


@pytest.mark.parametrize(
    ("job_name", "extra"),
    [("kill-job", []), ("kill-job-async", ["name=kill-job-async", "schedule.max_staleness=4"])],
)
def test_sigkilled_job_resumes_from_its_last_checkpoint(
    prefect_api, flowrl_home, moto_s3, monkeypatch, tmp_path, job_name, extra
):
    import s3fs
    from prefect.settings import PREFECT_API_URL

    from flowrl.infra.tracking import client

    storage = f"{moto_s3.url}/flowrl"
    monkeypatch.setenv("FLOWRL_STORAGE_URL", storage)
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    latest = f"{moto_s3.bucket}/flowrl/jobs/{job_name}/checkpoints/LATEST.json"
    s3 = s3fs.S3FileSystem(skip_instance_cache=True)

    def checkpointed() -> int | None:
        s3.invalidate_cache()
        return json.loads(s3.cat(latest))["step"] if s3.exists(latest) else None

    first = _train(env, tmp_path / "first.log", extra)
    killed_after = kill_after_checkpoint(first, checkpointed, tmp_path / "first.log")
    assert killed_after < STEPS

    second = _train(env, tmp_path / "second.log", extra)
    assert second.wait(600) == 0, (tmp_path / "second.log").read_text()[-3000:]
    output = (tmp_path / "second.log").read_text()
    assert f"registered model                     : models:/{job_name}/" in output
    # quiet by default: no third party's progress bars or warnings among flowrl's own lines
    assert "Downloading artifacts" not in output and "WARNING" not in output, output[-3000:]

    result = json.loads(s3.cat(f"{moto_s3.bucket}/flowrl/jobs/{job_name}/result.json"))
    c = client()
    steps = [m.step for m in c.get_metric_history(result["mlflow_run_id"], "reward/mean")]
    # Every step once: the steps after the checkpoint ran again, but what the killed run had
    # already sent for them is not logged a second time.
    assert sorted(steps) == list(range(1, STEPS + 1)), (killed_after, steps)
    name, version = result["model_uri"].removeprefix("models:/").split("/")
    assert c.get_model_version(name, version).run_id == result["mlflow_run_id"]
    print(f"\nkilled after checkpoint {killed_after}; resumed; registered {result['model_uri']}")


def test_a_terminated_run_leaves_nothing_running(tmp_path):
    """SIGTERM to `flowrl train` (what `kill` or a process manager sends) ends it as Ctrl-C
    does: exit status 143, and nothing it started lives on: not its local Ray, not its
    workers. Without PREFECT_API_URL the command serves Prefect's temporary API from a thread
    of its own process (``flows.engines._TemporaryPrefectAPI``): no server process at all."""
    import psutil

    drop = ("PREFECT_API_URL", "FLOWRL_PREFECT_API_URL", "RAY_ADDRESS", "MLFLOW_TRACKING_URI")
    drop += ("FLOWRL_STORAGE_URL",)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    home = tmp_path / "home"
    env |= {"FLOWRL_HOME": str(home), "PREFECT_HOME": str(tmp_path / "prefect-home")}
    latest = home / "storage" / "jobs" / "kill-job" / "checkpoints" / "LATEST.json"
    log = tmp_path / "run.log"
    job = start_job("train", ARGS, env, log)
    commands: set[str] = set()
    with job_tree(job) as started:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and job.poll() is None and not latest.exists():
            commands = collect_children(job, started)
            time.sleep(0.2)
        assert latest.exists(), log.read_text()[-3000:]
        assert any("raylet" in c for c in commands), commands
        assert not any("uvicorn" in c or "prefect" in c for c in commands), commands
        job.send_signal(signal.SIGTERM)  # the command's own process, not its group
        assert job.wait(120) == 128 + signal.SIGTERM, log.read_text()[-3000:]
        gone, alive = psutil.wait_procs(list(started.values()), timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
    # its last line is flowrl's own (no Ray stack dump, no traceback after it)
    lines = [x.strip() for x in log.read_text().replace("\r", "\n").splitlines() if x.strip()]
    assert lines[-1] == (
        "flowrl: job 'kill-job' stopped by SIGTERM (exit 143) (the same command resumes it "
        "from its last checkpoint)"
    ), lines[-10:]
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def test_a_run_terminated_while_its_servers_start_leaves_nothing_running(tmp_path):
    """`flowrl train` starts Ray and Prefect's API side by side while it imports the flow
    (``flows.engines.start_engines``); SIGTERM in that window (Ray's GCS is up, the flow has
    not begun) ends the command with 143 and leaves none of Ray's processes running."""
    import psutil

    drop = ("PREFECT_API_URL", "FLOWRL_PREFECT_API_URL", "RAY_ADDRESS", "MLFLOW_TRACKING_URI")
    env = {k: v for k, v in os.environ.items() if k not in drop + ("FLOWRL_STORAGE_URL",)}
    env |= {"FLOWRL_HOME": str(tmp_path / "home"), "PREFECT_HOME": str(tmp_path / "prefect")}
    log = tmp_path / "run.log"
    job = start_job("train", ARGS, env, log)
    with job_tree(job) as started:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and job.poll() is None:
            names = collect_children(job, started)
            if any("gcs_server" in n for n in names):
                break
            time.sleep(0.05)
        assert "Beginning flow run" not in log.read_text(), "the flow began: too late"
        job.send_signal(signal.SIGTERM)
        assert job.wait(60) == 128 + signal.SIGTERM, log.read_text()[-3000:]
        time.sleep(2)  # anything the dying threads still started shows up as a child by now
        gone, alive = psutil.wait_procs(list(started.values()), timeout=30)
        assert not alive, [(p.pid, p.name()) for p in alive]
        leftovers = [
            p.info["cmdline"]
            for p in psutil.process_iter(["cmdline", "environ"])
            if (p.info["environ"] or {}).get("PREFECT_HOME") == env["PREFECT_HOME"]
        ]
        assert not leftovers, leftovers


@contextlib.contextmanager
def job_tree(job: subprocess.Popen) -> Iterator[dict]:
    """The processes ``job`` started that the test has seen (``collect_children``): whatever
    of them, and the job, still runs at the end is killed."""
    import psutil

    started: dict[int, psutil.Process] = {}
    try:
        yield started
    finally:
        if job.poll() is None:
            job.kill()
        for p in started.values():
            with contextlib.suppress(psutil.Error):
                p.kill()


def collect_children(job: subprocess.Popen, started: dict) -> set[str]:
    """Add ``job``'s descendants to ``started`` (pid → process); the command lines of all
    seen so far."""
    import psutil

    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(job.pid).children(recursive=True):
            started.setdefault(child.pid, child)
    commands = set()
    for child in list(started.values()):
        with contextlib.suppress(psutil.Error):
            commands.add(" ".join(child.cmdline()))
    return commands


def test_sigterm_mid_evaluation_exits_in_seconds_without_a_second_ray(tmp_path):
    """SIGTERM while the evaluation before RL waits on environment calls that hang (their
    deadline ten minutes away): `flowrl train` exits within 15 s with status 143, its MLflow
    run is FAILED, and no second local Ray is started on the way out (Ray's auto-init is off
    once the job has connected). Its local Ray runs without the daemons no job uses."""
    import mlflow
    import psutil

    drop = ("PREFECT_API_URL", "FLOWRL_PREFECT_API_URL", "RAY_ADDRESS", "MLFLOW_TRACKING_URI")
    drop += ("FLOWRL_STORAGE_URL",)
    env = {k: v for k, v in os.environ.items() if k not in drop}
    home = tmp_path / "home"
    env |= {"FLOWRL_HOME": str(home), "PREFECT_HOME": str(tmp_path / "prefect-home")}
    args = [
        "name=sigterm-eval",
        "env.name=tests.hangs:Hanging",
        f"env.params.evaluating={tmp_path}",
        "env.step_timeout_s=600",
        "env.eval_size=8",
        "warmup.enabled=false",
        "rollout.prompts_per_step=4",
        "rollout.group_size=2",
        "schedule.steps=2",
    ]
    log = tmp_path / "run.log"
    job = start_job("train", args, env, log)
    raylets: set[int] = set()

    def watch() -> None:
        # A raylet whose parent is a raylet is one of its forks caught before its exec (a worker
        # or agent it starts; seen on a loaded Intel machine), not a second Ray.
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(job.pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    if child.name() == "raylet" and child.parent().name() != "raylet":
                        raylets.add(child.pid)

    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and job.poll() is None:
            watch()
            if (tmp_path / "evaluating").exists():
                break
            time.sleep(0.2)
        assert (tmp_path / "evaluating").exists(), log.read_text()[-3000:]
        time.sleep(1.0)  # well inside the evaluation's hung resets
        # Who gets the CPU: the policy's worker and the servers at 0, Ray's helper daemons at
        # FLOWRL_RAY_DAEMON_NICENESS (10). Prefect's temporary API is the job's process itself.
        nice = _niceness_by_kind(job.pid)
        assert psutil.Process(job.pid).nice() == 0
        for process in ("ray::ColocatedWorker", "raylet", "gcs_server"):
            assert nice[process] == {0}, nice
        for daemon in ("ray::DashboardAgent", "ray::RuntimeEnvAgent"):
            assert nice[daemon] == {10}, nice
        # The daemons no job uses are gone (FLOWRL_RAY_LOCAL_DAEMONS: needed).
        unused = {"Ray dashboard", "Ray log monitor", "Ray autoscaler monitor"}
        assert not unused & nice.keys(), nice
        ours = set(raylets)  # the job's own Ray
        assert ours, nice
        job.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while job.poll() is None and time.monotonic() - signalled < 60:
            watch()
            time.sleep(0.1)
        seconds = time.monotonic() - signalled
        assert job.returncode == 128 + signal.SIGTERM, log.read_text()[-3000:]
        assert seconds <= 15, (seconds, log.read_text()[-3000:])
        assert raylets == ours, (ours, raylets)  # no Ray started on the way out
        client = mlflow.MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
        runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
        assert [r.info.status for r in runs] == ["FAILED"], [r.info for r in runs]
        print(f"\nSIGTERM mid-evaluation: exited in {seconds:.1f} s")
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)


def _niceness_by_kind(pid: int) -> dict[str, set[int]]:
    """The niceness of ``pid``'s descendants, by kind (Ray actors by class)."""
    import psutil

    kinds: dict[str, set[int]] = {}
    for child in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            name, cmd = child.name(), " ".join(child.cmdline())
            kind = name
            if cmd.startswith("ray::"):
                kind = "ray::" + cmd.split()[0][5:].split(".")[0].rsplit(":", 1)[-1]
            elif "/dashboard/dashboard.py" in cmd:
                kind = "Ray dashboard"
            elif "/log_monitor.py" in cmd:
                kind = "Ray log monitor"
            elif "/monitor.py" in cmd and "/ray/" in cmd:
                kind = "Ray autoscaler monitor"
            kinds.setdefault(kind, set()).add(child.nice())
    return kinds


TEMPORARY_API_SCRIPT = """
import socket, time
from flowrl.flows.engines import _TemporaryPrefectAPI
api = _TemporaryPrefectAPI()
probe = socket.socket()
try:
    probe.bind(("127.0.0.1", api.port))
    print("port free before the API served it")
except OSError:
    pass
api.adopt()
from prefect import flow, task
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

@task
def one():
    return 1

@flow
def two():
    return one() + one()

state = two(return_state=True)
assert state.result() == 2
only = FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
deadline = time.monotonic() + 30
with get_client(sync_client=True) as client:
    while len(client.read_task_runs(flow_run_filter=only)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    print("task runs recorded:", len(client.read_task_runs(flow_run_filter=only)))
"""


def test_the_temporary_prefect_api_holds_its_port_and_records_task_runs(tmp_path):
    """The API ``flowrl train`` serves from its own process holds its port from the moment it
    is chosen (no other process can take it before it serves: one that did made it serve
    Prefect's cached app again, with no services), and its services record a flow's task
    runs, as the UI shows them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env |= {"PREFECT_HOME": str(tmp_path / "prefect-home")}
    out = subprocess.run(
        [sys.executable, "-c", TEMPORARY_API_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.splitlines() == ["task runs recorded: 2"], out.stdout + out.stderr[-2000:]
