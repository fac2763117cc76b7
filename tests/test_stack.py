"""The local stack for real (PostgreSQL, S3 on disk, MLflow server, Prefect server + process
worker, Ray head, all under supervisord) and the scheduler under load, judged by Prefect's own
flow-run state history; then the stack under faults: components SIGKILLed and restarted, a job's
process SIGKILLed and resumed by itself, ``stack down`` / ``stack up`` losing nothing.

Load test: 12 probe jobs submitted at once to queues `lo` (limit 1, priority 2; submitted
first) and `hi` (limit 2, priority 1), pool limit 2, 2 GPU slots, jobs holding 1 or 2 slots.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from services import flowrl_to_a_closed_pipe

from flowrl.infra.client import JobClient

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
PROBE = "gpu-probe/gpu-probe"


@pytest.fixture(scope="module")
def probe_deployment(local_stack):
    """The gpu-probe flow deployed from this checkout on the test pool (default queue hi)."""
    _deploy(local_stack, str(REPO), "flowrl.flows.probe.gpu_probe", "gpu-probe")
    return PROBE


def _deploy(
    local_stack, source: str, entrypoint: str, name: str, tags: list[str] | None = None
) -> None:
    """Deploy the flow at ``entrypoint`` of ``source`` (a folder) as ``name`` on the test
    pool's queue hi."""
    from prefect.flows import Flow
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flowrl.infra.scheduler import load_scheduler

    os.environ["FLOWRL_SCHEDULER_FILE"] = local_stack.env["FLOWRL_SCHEDULER_FILE"]
    try:
        pool = load_scheduler().pool.name
    finally:
        os.environ.pop("FLOWRL_SCHEDULER_FILE")
    with temporary_settings(updates={PREFECT_API_URL: local_stack.env["PREFECT_API_URL"]}):
        Flow.from_source(source, entrypoint).deploy(
            name,
            work_pool_name=pool,
            work_queue_name="hi",
            tags=tags,
            build=False,
            push=False,
            print_next_steps=False,
            ignore_warnings=True,
        )


def _history(run_id: str) -> dict[str, list[float]]:
    """State type -> timestamps (epoch seconds) from the flow run's state history."""
    from uuid import UUID

    from prefect import get_client

    with get_client(sync_client=True) as c:
        states = c.read_flow_run_states(UUID(run_id))
    out: dict[str, list[float]] = {}
    for s in states:
        out.setdefault(s.type.value, []).append(s.timestamp.timestamp())
    return out


def _peak(intervals: list[tuple[float, float, int]]) -> int:
    """Largest sum of weights of intervals [start, end) open at once (ends before starts)."""
    events = sorted([(a, 1, w) for a, _, w in intervals] + [(b, 0, -w) for _, b, w in intervals])
    level = peak = 0
    for _, _, w in events:
        level += w
        peak = max(peak, level)
    return peak


def test_stack_components_answer(stack_env):
    env = stack_env.env
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(f"{stack_env.components['mlflow'].url}/health", timeout=10) as r:
        assert r.status == 200
    with opener.open(f"{env['PREFECT_API_URL']}/health", timeout=10) as r:
        assert r.status == 200
    import s3fs

    assert s3fs.S3FileSystem(skip_instance_cache=True).exists("flowrl")  # the stack's bucket
    probe = (
        f"import ray, json; ray.init(address='{env['FLOWRL_RAY_ADDRESS']}', log_to_driver=False); "
        "print(json.dumps(ray.cluster_resources()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    resources = json.loads(out.stdout.strip().splitlines()[-1])
    assert resources["GPU"] == 2  # the Ray head has the pool's GPUs (logical on CPU)
    with opener.open(f"{env['TINKER_BASE_URL']}/api/v1/healthz", timeout=10) as r:
        assert json.load(r) == {"status": "ok"}  # the Tinker API, for `flowrl stack env` users
    import openai  # the OpenAI-compatible endpoint, found as `flowrl stack env` prints it

    client = openai.OpenAI(base_url=env["OPENAI_BASE_URL"], api_key="local", max_retries=0)
    assert "flowrl/tiny" in [m.id for m in client.models.list()]
    answer = client.chat.completions.create(
        model="flowrl/tiny", messages=[{"role": "user", "content": "1+1?"}], max_tokens=2
    )
    assert answer.usage.completion_tokens <= 2


def test_submission_to_start_latency_on_an_idle_pool(stack_env, probe_deployment):
    jobs = JobClient()
    run_id = jobs.submit(probe_deployment, {"seconds": 0.1, "gpus": 1})
    assert jobs.wait(run_id, timeout=180).state == "COMPLETED"
    h = _history(run_id)
    latency = h["RUNNING"][0] - h["SCHEDULED"][0]
    claimed = h["PENDING"][0] - h["SCHEDULED"][0]
    print(f"\nsubmission -> PENDING {claimed:.2f} s, submission -> RUNNING {latency:.2f} s")
    assert claimed <= 5.0  # the worker polls every second
    assert latency <= 30.0  # plus starting the flow-run process on a loaded 2-core box


def test_a_job_larger_than_the_pool_is_refused_by_the_cli(
    stack_env, probe_deployment, monkeypatch, capsys
):
    from flowrl.cli import main

    monkeypatch.setenv("PREFECT_LOGGING_LEVEL", "WARNING")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", stack_env.env["FLOWRL_MLFLOW_TRACKING_URI"])
    before = len(JobClient().list(limit=100))
    assert main(["jobs", "submit", PROBE, "--param", "gpus=3"]) == 2
    assert "resources.gpus=3 but the pool has 2 GPU" in capsys.readouterr().err
    assert len(JobClient().list(limit=100)) == before  # nothing was submitted


def test_load_limits_priority_and_no_job_lost_or_run_twice(stack_env, probe_deployment):
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    jobs = JobClient()
    submitted: dict[str, str] = {}
    for k in range(12):
        queue = "lo" if k < 6 else "hi"  # the low-priority jobs are the older ones
        run_id = jobs.submit(probe_deployment, {"seconds": 1.0, "gpus": 1 + k % 2}, queue=queue)
        submitted[run_id] = queue
    finals = {r: jobs.wait(r, timeout=420).state for r in submitted}
    assert set(finals.values()) == {"COMPLETED"}, finals

    runs = {}
    for run_id, queue in submitted.items():
        h = _history(run_id)
        # Ran exactly once: one RUNNING state (the worker and the engine both report PENDING).
        assert len(h["RUNNING"]) == 1 and len(h["COMPLETED"]) == 1, h
        runs[run_id] = (queue, h["SCHEDULED"][0], h["PENDING"][0], h["COMPLETED"][0])
    occupied = {q: [(p, e, 1) for qq, _, p, e in runs.values() if qq == q] for q in ("hi", "lo")}
    peaks = {q: _peak(v) for q, v in occupied.items()}
    peaks["pool"] = _peak(occupied["hi"] + occupied["lo"])

    with get_client(sync_client=True) as c:
        ids = [UUID(r) for r in submitted]
        artifacts = c.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids))
        )
    held = [json.loads(a.data) if isinstance(a.data, str) else a.data for a in artifacts]
    gpu_intervals = [(row[0]["acquired"], row[0]["released"], row[0]["gpus"]) for row in held]
    assert len(gpu_intervals) == 12
    peaks["gpu"] = _peak(gpu_intervals)
    print(f"\npeaks read from Prefect: {peaks}")
    assert peaks["hi"] <= 2 and peaks["lo"] <= 1 and peaks["pool"] <= 2 and peaks["gpu"] <= 2
    assert peaks["pool"] == 2 and peaks["gpu"] == 2  # the limits were actually reached

    # Priority: whenever a lo job started, no hi job was waiting that its queue could take.
    # Jobs the worker claims in one poll start within milliseconds of each other, in any
    # order: a hi job that started within ``tol`` of the lo job was not left waiting.
    tol = 0.5
    overtaken = 0
    for queue, _, start, _ in runs.values():
        if queue != "lo":
            continue
        hi_waiting = [
            r for r in runs.values() if r[0] == "hi" and r[1] < start - tol and r[2] > start + tol
        ]
        hi_running = [r for r in runs.values() if r[0] == "hi" and r[2] <= start < r[3]]
        assert not (hi_waiting and len(hi_running) < 2), (start, hi_waiting, hi_running)
        # lo jobs submitted earlier but still waiting when a later hi job started
        overtaken += sum(1 for r in runs.values() if r[0] == "hi" and r[2] < start and r[1] > 0)
    assert overtaken > 0  # higher-priority jobs submitted later did start first


def test_cancel_a_running_job(stack_env, probe_deployment):
    jobs = JobClient()
    run_id = jobs.submit(probe_deployment, {"seconds": 120, "gpus": 1})
    deadline = time.monotonic() + 120
    while jobs.status(run_id).state != "RUNNING":
        assert time.monotonic() < deadline
        time.sleep(0.5)
    jobs.cancel(run_id)
    assert jobs.wait(run_id, timeout=90).state == "CANCELLED"
    history = _history(run_id)
    assert "CRASHED" not in history, history  # straight from CANCELLING to CANCELLED
    assert "CANCELLING" in history, history


def _http_json(url: str) -> dict:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=30) as r:
        return json.loads(r.read())


def test_the_prefect_ui_talks_to_the_stacks_own_api(stack_env):
    """The UI a browser loads from the server's root asks ``/ui-settings`` where the API is:
    the stack's own port, not Prefect's default 4200."""
    ui = stack_env.ui["prefect"]
    assert ui.endswith("/") and not ui.endswith("/api/")
    settings = _http_json(f"{ui}ui-settings")
    assert settings["api_url"] == stack_env.env["PREFECT_API_URL"]
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(ui, timeout=30) as r:
        assert r.status == 200 and b"<html" in r.read().lower()
    with opener.open(stack_env.ui["mlflow"], timeout=30) as r:
        assert r.status == 200 and b"<html" in r.read().lower()


def test_stack_status_prints_both_ui_links(local_stack, monkeypatch, capsys):
    from flowrl.cli import main
    from flowrl.infra import stack

    monkeypatch.setenv("FLOWRL_HOME", local_stack.env["FLOWRL_HOME"])
    assert main(["stack", "status"]) == 0
    out = capsys.readouterr().out
    prefect_ui = local_stack.env["PREFECT_API_URL"].removesuffix("api")
    mlflow_ui = local_stack.env["FLOWRL_MLFLOW_TRACKING_URI"] + "/" + stack.MLFLOW_UI_PAGE
    assert f"Prefect UI  {prefect_ui}\n" in out and f"MLflow UI   {mlflow_ui}\n" in out
    for name, comp in local_stack.components.items():
        assert f"{name}" in out and str(comp.pid) in out
    assert main(["stack", "status", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["ui"] == {"prefect": prefect_ui, "mlflow": mlflow_ui}
    assert all(c["alive"] for c in status["components"].values())


def _client_env(**extra: str) -> dict[str, str]:
    """This process's environment without any pointer at a Prefect API or a flowrl home."""
    drop = ("PREFECT_API_URL", "FLOWRL_PREFECT_API_URL", "FLOWRL_HOME", "MLFLOW_TRACKING_URI")
    return {k: v for k, v in os.environ.items() if k not in drop} | extra


def _flowrl(*args: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "flowrl", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_flowrl_jobs_finds_the_stack_from_any_directory(stack_env, probe_deployment, tmp_path):
    """``stack up`` leaves a pointer in the user's config folder; ``flowrl jobs`` run from
    another directory, with no FLOWRL_HOME and no Prefect API set, follows it to the stack
    and writes nothing there. A malformed or unknown run id, or an unknown deployment, is one
    line and exit 1."""
    config = tmp_path / "config"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    home = stack_env.env["FLOWRL_HOME"]
    env = _client_env(FLOWRL_HOME=home, FLOWRL_CONFIG_DIR=str(config))
    up = _flowrl("stack", "up", cwd=elsewhere, env=env)  # already running: only re-points
    assert up.returncode == 0, up.stderr[-2000:]
    pointer = json.loads((config / "stack.json").read_text())
    assert pointer["state_file"] == str(Path(home) / "stack" / "state.json")

    env = _client_env(FLOWRL_CONFIG_DIR=str(config))
    run_id = JobClient().submit(probe_deployment, {"seconds": 0.1, "gpus": 1})
    listed = _flowrl("jobs", "list", cwd=elsewhere, env=env)
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert run_id in listed.stdout
    waited = _flowrl("jobs", "wait", run_id, "--timeout", "180", cwd=elsewhere, env=env)
    assert waited.returncode == 0 and f"{run_id}  COMPLETED" in waited.stdout, waited.stderr
    # --json: one document a script reads
    listed = json.loads(_flowrl("jobs", "list", "--json", cwd=elsewhere, env=env).stdout)
    mine = next(j for j in listed if j["id"] == run_id)
    assert mine["deployment"] == "gpu-probe" and mine["state"] == "COMPLETED" and mine["final"]
    status = json.loads(_flowrl("jobs", "status", run_id, "--json", cwd=elsewhere, env=env).stdout)
    assert status["state"] == "COMPLETED" and status["end_time"], status
    unknown = "00000000-0000-4000-8000-000000000000"
    before = len(JobClient().list(limit=50))
    for args, says in (
        (("jobs", "status", unknown), f"no flow run {unknown} on the Prefect API"),
        (("jobs", "wait", "not-an-id"), "'not-an-id' is not a flow-run id"),
        (("jobs", "result", unknown), f"no flow run {unknown}"),
        (("jobs", "logs", unknown, "-f"), f"no flow run {unknown}"),
        (("jobs", "cancel", unknown), f"no flow run {unknown}"),
        (("jobs", "metrics", unknown, "--json"), f"no flow run {unknown}"),
        (("jobs", "submit", "no-such-job"), "0 deployments are named 'no-such-job' on the"),
    ):
        out = _flowrl(*args, cwd=elsewhere, env=env)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 1 and len(lines) == 1, out.stderr
        assert lines[0].startswith(f"flowrl: {says}"), lines
    # parameters that do not fit the deployment: refused before anything is sent, a line each
    bad = ("--param", "seconds=soon", "--param", "gpus=many", "--param", "gpu=1")
    out = _flowrl("jobs", "submit", "gpu-probe", *bad, cwd=elsewhere, env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[1:] == [
        "  gpu: not a parameter here (expected one of ['gpus', 'seconds'])",
        "  gpus: 'many' is not of type 'integer'",
        "  seconds: 'soon' is not of type 'number'",
    ], out.stderr
    assert len(JobClient().list(limit=50)) == before
    # a reader that leaves before the listing is written: exit 1, nothing on stderr (stdout
    # block-buffered, as a user's shell has it)
    closed = flowrl_to_a_closed_pipe(["jobs", "list"], elsewhere, env)
    assert closed.returncode == 1 and closed.stderr == "", closed.stderr
    assert list(elsewhere.iterdir()) == []  # no ./.flowrl, nothing else


def _deploy_source(local_stack, folder: Path, source: str, name: str) -> str:
    """Deploy ``source`` (written to ``folder``) as ``name``, its flow function being ``name``
    with underscores, on the test pool's queue hi; returns ``flow/deployment``."""
    module = name.replace("-", "_")
    (folder / f"{module}.py").write_text(source)
    _deploy(local_stack, str(folder), f"{module}.py:{module}", name)
    return f"{name}/{name}"


STAGED_FLOW = """
from prefect import flow, get_run_logger, task


@task
def stage(k: int) -> int:
    if k == 2:
        get_run_logger().warning("stage 2 warns")
    return k


@flow(name="staged")
def staged(stages: int = 4) -> int:
    get_run_logger().info("flow line before the stages")
    total = sum(stage(k) for k in range(stages))
    get_run_logger().info("flow line after the stages")
    return total
"""


def test_runs_on_the_worker_send_no_task_run_info_lines(stack_env, tmp_path):
    """A flow run on the stack's worker: its own INFO lines and a task's warning reach the
    Prefect API, the task runs' "Finished in state Completed()" lines do not."""
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterId,
        LogFilter,
        LogFilterFlowRunId,
    )

    jobs = JobClient()
    run_id = jobs.submit(_deploy_source(stack_env, tmp_path, STAGED_FLOW, "staged"), {"stages": 4})
    assert jobs.wait(run_id, timeout=180).state == "COMPLETED"
    run = FlowRunFilter(id=FlowRunFilterId(any_=[UUID(run_id)]))
    of_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(run_id)]))
    deadline = time.monotonic() + 120
    with get_client(sync_client=True) as c:
        # The flow-run process sends its lines in batches, the last one after the run's state;
        # the API records task runs from their state events, which it takes in asynchronously
        # too (under load a task run can still read RUNNING after its flow run completed).
        while True:
            task_runs = c.read_task_runs(flow_run_filter=run)
            logs = c.read_logs(log_filter=of_run, limit=200)
            done = [t for t in task_runs if t.state and t.state.is_completed()]
            last_line = any(
                g.message.startswith("Finished in state") and not g.task_run_id for g in logs
            )
            if last_line and len(done) >= 4:
                break
            assert time.monotonic() < deadline, (
                [(t.name, t.state_type) for t in task_runs],
                [log.message for log in logs],
            )
            time.sleep(0.5)
    assert len(task_runs) == 4  # the stages did run as task runs, and no more
    flow_lines = [log.message for log in logs if log.task_run_id is None]
    task_lines = [(log.level, log.message) for log in logs if log.task_run_id is not None]
    assert "flow line before the stages" in flow_lines, flow_lines
    assert "flow line after the stages" in flow_lines, flow_lines
    assert task_lines == [(30, "stage 2 warns")], task_lines


STEPPED_FLOW = """
import os
import time

from prefect import flow, get_run_logger


@flow(name="stepped")
def stepped(steps: int = 6, fail: bool = False, gate: str = "", hold: str = "") -> None:
    log = get_run_logger()
    log.info("training: started")

    def wait_for(path: str) -> None:
        deadline = time.monotonic() + 120
        while path and not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.1)

    wait_for(gate)  # the test opens the gate once its followers are following
    for k in range(1, steps + 1):
        time.sleep(1.0)
        log.info(f"step {k}/{steps}: reward {k / 10:.3f}, 1.00 s/step")
        if k == 1:
            wait_for(hold)  # and this one once it has Ctrl-C'd a follower at step 1
    if fail:
        raise RuntimeError("the stepped flow fails as asked")
"""


def test_jobs_logs_follow_and_wait_show_the_steps_as_they_come(stack_env, tmp_path):
    """``flowrl jobs logs ID --follow`` prints the job's lines while it runs (the first step
    line well before the job ends) and exits with its state (0 COMPLETED, 1 FAILED); Ctrl-C
    stops following (exit 130, saying so), not the job;
    ``jobs logs`` without --follow prints what is there; ``jobs wait`` piped shows the step
    lines on stderr; --json is a JSON object per line."""
    from datetime import UTC, datetime

    deployment = _deploy_source(stack_env, tmp_path, STEPPED_FLOW, "stepped")
    jobs = JobClient()
    env = _client_env(PREFECT_API_URL=os.environ["PREFECT_API_URL"])
    gate, hold = tmp_path / "go", tmp_path / "on"
    run_id = jobs.submit(deployment, {"steps": 6, "gate": str(gate), "hold": str(hold)})
    command = [sys.executable, "-m", "flowrl", "jobs", "logs", run_id, "--follow"]
    pipes = {"cwd": tmp_path, "env": env, "stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    follower = subprocess.Popen(command, text=True, **pipes)
    # Ctrl-C'd at its first step line: as from a terminal, whatever this test's parent ignores
    # (a shell's background job ignores SIGINT, and so, inherited, would the CLI).
    as_from_a_terminal = (
        "import runpy, signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "runpy.run_module('flowrl', run_name='__main__')"
    )
    leaver = subprocess.Popen(
        [sys.executable, "-c", as_from_a_terminal, *command[3:]], text=True, **pipes
    )
    arrived: list[tuple[datetime, str]] = []

    def read_until(process: subprocess.Popen, text: str, keep: list | None = None) -> None:
        assert process.stdout is not None
        for line in process.stdout:  # a follower that ends first fails the assertion below
            if keep is not None:
                keep.append((datetime.now(UTC), line.rstrip("\n")))
            if text in line:
                return
        raise AssertionError(f"{text!r} never came: {process.wait()}, {keep}")

    # The steps begin once both followers are following (a CLI's start under load is slow).
    read_until(follower, "training: started", arrived)
    read_until(leaver, "training: started")
    gate.touch()
    read_until(leaver, "step 1/6")
    leaver.send_signal(signal.SIGINT)
    _, said = leaver.communicate(timeout=30)
    assert leaver.returncode == 130, said
    assert said.strip() == (
        f"flowrl: stopped following {run_id}; the job goes on (`flowrl jobs cancel {run_id}` "
        "stops it)"
    ), said
    hold.touch()  # the job held after step 1: it cannot have ended before the Ctrl-C
    assert follower.stdout is not None
    for line in follower.stdout:
        arrived.append((datetime.now(UTC), line.rstrip("\n")))
    assert follower.wait(timeout=60) == 0, follower.stderr.read() if follower.stderr else ""
    ended = jobs.status(run_id).end_time
    steps = [(t, text) for t, text in arrived if "  step " in text]
    assert [text.split("  ", 1)[1] for _, text in steps] == [
        f"step {k}/6: reward {k / 10:.3f}, 1.00 s/step" for k in range(1, 7)
    ], arrived
    assert ended is not None and steps[0][0] < ended, (steps[0], ended)  # live, not at the end
    assert any("training: started" in text for _, text in arrived), arrived
    assert "Traceback" not in (follower.stderr.read() if follower.stderr else "")

    # after the end: the whole log at once, as text and as JSON lines
    out = _flowrl("jobs", "logs", run_id, cwd=tmp_path, env=env)
    assert out.returncode == 0 and "step 6/6: reward 0.600" in out.stdout, out.stderr
    as_json = _flowrl("jobs", "logs", run_id, "--json", cwd=tmp_path, env=env)
    records = [json.loads(x) for x in as_json.stdout.splitlines()]
    assert {"time", "level", "message", "task_run_id"} <= set(records[0]), records[0]
    assert [r["message"] for r in records if r["message"].startswith("step ")][-1] == (
        "step 6/6: reward 0.600, 1.00 s/step"
    )

    # wait, piped: the step lines on stderr, the status on stdout; a failed job exits 1
    failing = jobs.submit(deployment, {"steps": 2, "fail": True})
    waited = _flowrl("jobs", "wait", failing, "--timeout", "120", cwd=tmp_path, env=env)
    assert waited.returncode == 1 and f"{failing}  FAILED" in waited.stdout, waited.stderr
    assert waited.stderr.splitlines() == [
        "step 1/2: reward 0.100, 1.00 s/step",
        "step 2/2: reward 0.200, 1.00 s/step",
    ], waited.stderr
    followed = _flowrl("jobs", "logs", failing, "-f", cwd=tmp_path, env=env)
    assert followed.returncode == 1 and "the stepped flow fails as asked" in followed.stdout
    assert "Traceback" not in followed.stderr, followed.stderr


RAY_SLEEPER_FLOW = """
import time

from prefect import flow, get_run_logger

from flowrl.flows.lifecycle import task_runner


@flow(name="ray-sleeper", task_runner=task_runner())
def ray_sleeper(seconds: float = 120.0) -> None:
    get_run_logger().info("on Ray, sleeping")
    time.sleep(seconds)
"""


def test_cancel_a_running_job_on_ray(stack_env, tmp_path):
    """A flow on flowrl's stage runner (a Ray driver, as every training flow is), cancelled
    while it runs: CANCELLING, then CANCELLED, never CRASHED. ``ray.init`` replaces the SIGTERM
    handler; the runner puts Prefect's back, so the worker's SIGTERM is taken as the cancel it
    announced, not as a crash ("Execution was aborted by Python system exit call")."""
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    jobs = JobClient()
    run_id = jobs.submit(_deploy_source(stack_env, tmp_path, RAY_SLEEPER_FLOW, "ray-sleeper"))
    of_run = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(run_id)]))
    deadline = time.monotonic() + 180
    with get_client(sync_client=True) as c:
        while not any(g.message == "on Ray, sleeping" for g in c.read_logs(log_filter=of_run)):
            assert time.monotonic() < deadline, jobs.status(run_id)
            time.sleep(0.5)
    jobs.cancel(run_id)
    assert jobs.wait(run_id, timeout=90).state == "CANCELLED"
    history = _history(run_id)
    assert "CRASHED" not in history and "CANCELLING" in history, history


def _gpu_slots_in_use() -> int:
    from prefect import get_client

    with get_client(sync_client=True) as c:
        return c.read_global_concurrency_limit_by_name("gpu").active_slots


def test_a_killed_job_gives_its_gpu_slots_back(stack_env, probe_deployment):
    """SIGKILL leaves no chance to release: the slots come back when the lease (60 s, Prefect's
    minimum) runs out, and the next job that needs every GPU runs."""
    import signal

    jobs = JobClient()
    run_id = jobs.submit(probe_deployment, {"seconds": 300, "gpus": 2})
    deadline = time.monotonic() + 120
    while _gpu_slots_in_use() < 2:
        assert time.monotonic() < deadline, jobs.status(run_id)
        time.sleep(0.5)
    from uuid import UUID

    from prefect import get_client

    with get_client(sync_client=True) as c:
        pid = int(str(c.read_flow_run(UUID(run_id)).infrastructure_pid).rsplit(":", 1)[-1])
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while _gpu_slots_in_use() > 0:
        assert time.monotonic() - killed < 120, "the killed job still holds its GPU slots"
        time.sleep(0.5)
    freed_after = time.monotonic() - killed
    print(f"\nGPU slots of a SIGKILLed job back after {freed_after:.1f} s (lease 60 s)")
    assert jobs.wait(run_id, timeout=60).state == "CRASHED"
    after = jobs.submit(probe_deployment, {"seconds": 0.1, "gpus": 2})
    assert jobs.wait(after, timeout=180).state == "COMPLETED"


# ------------------------------------------------------------------ Tinker API sessions


@pytest.fixture
def tinker_sessions(stack_env, tmp_path) -> Iterator[str]:
    """``flowrl serve tinker --placement sessions`` on the stack, with a 20 s heartbeat TTL
    (the SDK beats every 10 s), its ``tinker-session`` runs on the test pool's queue hi;
    yields its URL."""
    import socket

    _deploy(stack_env, str(REPO), "flowrl.flows.tinker_session.tinker_session", "tinker-session")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    cmd = [sys.executable, "-m", "flowrl", "serve", "tinker", "--placement", "sessions"]
    cmd += ["--port", str(port), "--insecure-loopback", "--session-ttl", "20"]
    log = open(tmp_path / "tinker.log", "wb")
    proc = subprocess.Popen(cmd, env={**os.environ, **stack_env.env}, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    try:
        from flowrl.infra.servers import wait_for_http

        wait_for_http(f"{url}/api/v1/healthz", 120, proc)
        yield url
    finally:
        proc.terminate()
        proc.wait(60)


def _tinker_runs(state: str | None = None) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import FlowFilter, FlowFilterName

    with get_client(sync_client=True) as c:
        runs = c.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=["tinker-session"]))
        )
    return [r for r in runs if state is None or r.state_type.value == state]


def test_tinker_sessions_are_flow_runs_holding_gpu_slots(tinker_sessions, stack_env):
    """A training client of the Tinker SDK is a ``tinker-session`` flow run that holds a
    ``gpu`` slot while it lives, logs its losses to MLflow, and ends COMPLETED, its slot given
    back, when the client closes its session, or when a client stops heartbeating (TTL)."""
    import httpx
    import tinker
    from tinker import types

    before = {r.id for r in _tinker_runs()}
    client = tinker.ServiceClient(base_url=tinker_sessions, api_key="tml-" + "t" * 24)
    tc = client.create_lora_training_client("flowrl/tiny", rank=4, seed=0).result()
    assert _gpu_slots_in_use() == 1
    (run,) = [r for r in _tinker_runs("RUNNING") if r.id not in before]
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
        )
    ]
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(data, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        losses.append(fb.result().metrics["loss:sum"])
    assert losses[-1] < losses[0]
    path = tc.save_state("in-s3").result().path  # the stack's storage is its S3 bucket
    import s3fs

    run_dir = tc.get_info().model_id.replace(":train:", "-train-")
    found = s3fs.S3FileSystem(skip_instance_cache=True).find(f"flowrl/storage/tinker/{run_dir}")
    assert any(f.endswith("weights/in-s3/adapter.safetensors") for f in found), (path, found)
    client.close("success").result()
    jobs = JobClient()
    assert jobs.wait(str(run.id), timeout=120).state == "COMPLETED"
    assert _gpu_slots_in_use() == 0
    metrics = jobs.metrics(str(run.id))  # the session's MLflow run
    assert metrics["optim/lr"] == pytest.approx(1e-2) and "train/loss_sum" in metrics
    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as c:
        lines = [
            g.message
            for g in c.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id]))
            )
        ]
    assert any(" ready: flowrl/tiny, LoRA rank 4" in line for line in lines), lines
    assert any("unloaded after 4 optimizer steps" in line for line in lines), lines

    # A client that never heartbeats: its model is unloaded after the TTL, its slot freed.
    key = {"X-API-Key": "tml-" + "t" * 24}

    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{tinker_sessions}/api/v1/{path}", json=body, headers=key, timeout=60)

    session = post("create_session", {"tags": [], "user_metadata": {}, "sdk_version": "x"}).json()
    request = {"session_id": session["session_id"], "model_seq_id": 0, "base_model": "flowrl/tiny"}
    future = post("create_model", {**request, "lora_config": {"rank": 4}}).json()
    deadline = time.monotonic() + 120
    while post("retrieve_future", {"request_id": future["request_id"]}).status_code != 200:
        assert time.monotonic() < deadline
    (silent,) = [r for r in _tinker_runs() if r.id not in before | {run.id}]
    assert jobs.wait(str(silent.id), timeout=120).state == "COMPLETED"
    assert _gpu_slots_in_use() == 0
    gone = post("get_info", {"model_id": future["model_id"]})
    assert gone.status_code == 410 and "no heartbeat" in gone.json()["detail"]


def test_a_tinker_loop_carries_on_through_a_kill_of_the_service(stack_env):
    """The stack's Tinker API SIGKILLed while an SDK loop has calls in flight: the supervisor
    starts it again, it recovers its journal (sessions, the model in its session run's actor,
    the calls not yet answered) and the loop carries on, none the wiser: its losses fall, and
    the model took each optimizer step once."""
    import tinker
    from tinker import types

    _deploy(stack_env, str(REPO), "flowrl.flows.tinker_session.tinker_session", "tinker-session")
    client = tinker.ServiceClient(
        base_url=stack_env.env["TINKER_BASE_URL"], api_key="tml-" + "k" * 24
    )
    tc = client.create_lora_training_client("flowrl/tiny", rank=4, seed=0).result()
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
        )
    ]
    # The same lesson as ``data`` (the next token is one more), longer and many times over: a
    # batch that takes the model seconds, in flight when the service is killed.
    tokens = list(range(5, 101))
    one = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 95},
    )
    long = [one] * 256
    before = _status(stack_env)["tinker"]
    losses = []
    for step in range(10):
        fb = tc.forward_backward(long if step == 4 else data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        if step == 4:
            time.sleep(0.5)  # the calls reach the service
            os.kill(before["pid"], signal.SIGKILL)
        opt.result()
        out = fb.result()
        if step != 4:
            losses.append(out.metrics["loss:sum"])
    after = _status(stack_env)["tinker"]
    assert after["restarts"] == before["restarts"] + 1 and after["pid"] != before["pid"]
    # It learns on, from where it was (the long batch's step moves it; the steps after it,
    # on the restarted service, bring the loss down again).
    assert losses[3] < losses[0] and losses[-1] < losses[4], losses
    recovered = [
        line
        for line in Path(after["log"]).read_text().splitlines()
        if "unanswered calls recovered" in line
    ]
    assert recovered and "1 of 1 models" in recovered[-1], recovered
    replayed = int(recovered[-1].split(" unanswered calls")[0].rsplit(" ", 1)[-1])
    assert replayed >= 1, recovered  # the long batch's call (and the step after it), again
    model_id = tc.get_info().model_id
    (run,) = [r for r in _tinker_runs("RUNNING") if r.parameters["config"]["model_id"] == model_id]
    run_id = str(run.id)
    client.close("success").result()
    assert JobClient().wait(run_id, timeout=120).state == "COMPLETED"
    assert _line(run_id, "unloaded after 10 optimizer steps", 30)  # none ran twice


# ------------------------------------------------------- shared base-model worker's tenants


def _lines(run_id: str) -> list[str]:
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    only = LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(run_id)]))
    lines: list[str] = []
    with get_client(sync_client=True) as c:
        while True:  # the API answers 200 lines at most a call
            page = c.read_logs(log_filter=only, limit=200, offset=len(lines))
            lines += [g.message for g in page]
            if len(page) < 200:
                return lines


def _line(run_id: str, wanted: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        lines = _lines(run_id)
        found = [line for line in lines if wanted in line]
        if found:
            return found[0]
        if time.monotonic() >= deadline:
            status = JobClient().status(run_id)  # said whole: how the run ended, its last lines
            last = "\n".join(lines[-15:])
            raise AssertionError(
                f"{wanted!r} not logged in {timeout_s:.0f} s; the run is {status.state}"
                f" ({status.message}), ended {status.end_time}; its last lines:\n{last}"
            )
        time.sleep(1.0)


def test_shared_worker_tenants_across_flow_runs(stack_env):
    """Two rl-train flow runs (worker subprocesses) with resources.placement shared on the
    stack's Ray: the second waits for the one adapter slot, the first is SIGKILLed, its slot
    comes back with its lease, and the second joins the same running worker (same process,
    base loaded once) and completes."""
    import re
    import signal
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate

    _deploy(stack_env, str(REPO), "flowrl.flows.rl.rl_train", "rl-train-shared")
    jobs = JobClient()

    def config(name: str, seed: int, steps: int) -> dict:
        return {
            "name": name,
            "seed": seed,
            "model": {"lora": {"enabled": True}},
            "resources": {"placement": "shared"},
            # Steps of 32 prompts: a tiny model's steps of 8 (~10 a second, each three task
            # runs) kept the stack's SQLite-backed Prefect API so busy that the worker's next
            # submission was refused with 503 ("database is locked" on a write that began as a
            # read, which no busy timeout waits out).
            "rollout": {"prompts_per_step": 32},
            "schedule": {"steps": steps, "eval_every": 1000, "checkpoint_every": 1000},
        }

    first = jobs.submit("rl-train/rl-train-shared", {"config": config("tenant-a", 1, 5000)})
    joined = _line(first, "policy: tenant", 300)
    worker, pid = re.search(r"shared worker (shared-\w+) \(pid (\d+)", joined).groups()
    # While it trains, the stack's OpenAI endpoint serves its current policy: its adapter on
    # the shared worker, found through the job's record in the stack's S3 storage.
    import openai

    endpoint = openai.OpenAI(base_url=stack_env.env["OPENAI_BASE_URL"], api_key="local")
    deadline = time.monotonic() + 60
    while "job:tenant-a" not in [m.id for m in endpoint.models.list()]:
        assert time.monotonic() < deadline
        time.sleep(1.0)
    answer = endpoint.chat.completions.create(
        model="job:tenant-a", messages=[{"role": "user", "content": "1+1?"}], max_tokens=4
    )
    assert answer.system_fingerprint.startswith("weights-")
    assert 0 < answer.usage.completion_tokens <= 4
    limit = f"adapter-slots-{worker}"
    with get_client(sync_client=True) as c:  # an operator sets the worker to one adapter slot
        c.update_global_concurrency_limit(limit, GlobalConcurrencyLimitUpdate(limit=1))
    second = jobs.submit("rl-train/rl-train-shared", {"config": config("tenant-b", 2, 3)})
    _line(second, f"waiting for an adapter slot of shared worker {worker}", 300)
    time.sleep(10)
    assert not [line for line in _lines(second) if "adapter slot of" in line and "held" in line]
    with get_client(sync_client=True) as c:
        infra = str(c.read_flow_run(UUID(first)).infrastructure_pid)
    os.kill(int(infra.rsplit(":", 1)[-1]), signal.SIGKILL)
    killed = time.monotonic()
    held = _line(second, f"adapter slot of {worker} held", 180)
    print(f"\n{held}; the killed tenant's slot came back {time.monotonic() - killed:.0f} s after")
    assert jobs.wait(second, timeout=300).state == "COMPLETED"
    assert "job:tenant-b" not in [m.id for m in endpoint.models.list()]  # it has ended
    rejoined = _line(second, "policy: tenant", 10)
    assert f"shared worker {worker} (pid {pid}, base loaded 1 time" in rejoined, rejoined
    assert jobs.wait(first, timeout=60).state == "CRASHED"
    with get_client(sync_client=True) as c:
        assert c.read_global_concurrency_limit_by_name(limit).active_slots == 0


# ---------------------------------------------------------------- the stack under faults

RESUME_JOB = "resume-me"
RESUME_STEPS = 40
OUTAGE_STEPS = 150
OUTAGE_S = 60.0


def _infra_pid(run_id: str) -> int:
    from uuid import UUID

    from prefect import get_client

    with get_client(sync_client=True) as c:
        return int(str(c.read_flow_run(UUID(run_id)).infrastructure_pid).rsplit(":", 1)[-1])


def _small_rl_job(name: str, steps: int) -> dict:
    """A few dozen quick steps of the tiny model, a checkpoint every 10 (no warm-up: what is
    learnt is not the point here)."""
    return {
        "name": name,
        "warmup": {"enabled": False},
        "rollout": {"prompts_per_step": 8, "group_size": 4},
        "schedule": {"steps": steps, "eval_every": 1000, "checkpoint_every": 10},
    }


def _wait_for(what: str, check, timeout_s: float, poll: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while True:
        found = check()
        if found:
            return found
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(poll)


def test_a_killed_job_resumes_from_its_checkpoint_by_itself(stack_env):
    """SIGKILL of a running rl-train job's process, with no command typed after it: the resume
    automation schedules the same flow run again, it is RUNNING again within 2 minutes,
    resumes from its last checkpoint and completes; its MLflow run is one run with each step's
    metrics once."""
    import s3fs

    from flowrl.infra import tracking
    from flowrl.infra.scheduler import RESUME_TAG

    _deploy(stack_env, str(REPO), "flowrl.flows.rl.rl_train", "rl-train-resume", [RESUME_TAG])
    jobs = JobClient()
    run_id = jobs.submit("rl-train/rl-train-resume", {"config": _small_rl_job(RESUME_JOB, 40)})
    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    latest = f"flowrl/storage/jobs/{RESUME_JOB}/checkpoints/LATEST.json"
    _wait_for("a first checkpoint", lambda: fs.exists(latest), 300)
    os.kill(_infra_pid(run_id), signal.SIGKILL)
    killed = time.monotonic()
    _wait_for("CRASHED", lambda: "CRASHED" in _history(run_id), 60)

    def again() -> bool:
        status = jobs.status(run_id)
        return status.state == "RUNNING" and status.attempts == 2

    _wait_for("RUNNING again", again, 120)
    back = time.monotonic() - killed
    print(f"\nthe SIGKILLed job was RUNNING again {back:.0f} s after the kill")
    final = jobs.wait(run_id, timeout=600)
    assert final.state == "COMPLETED", final
    history = _history(run_id)
    assert len(history["CRASHED"]) == 1 and len(history["RUNNING"]) == 2, history
    assert _line(run_id, "attempt 2 of 3: resuming after a crash", 10)
    result = jobs.result(run_id)
    assert result["steps"] == RESUME_STEPS and result["resumed_from"] >= 10, result
    client = tracking.client()
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string=f"tags.`flowrl.job` = '{RESUME_JOB}'",
    )
    assert [r.info.run_id for r in runs] == [result["mlflow_run_id"]]  # one run, carried on
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "reward/mean")]
    assert sorted(steps) == list(range(1, RESUME_STEPS + 1)), steps  # each step once


def test_the_resumer_catches_what_the_automation_missed(stack_env):
    """The stack's resumer (``infra/resumer.py``), on the stack's Prefect API: a run RUNNING
    whose process is gone is marked CRASHED (on the second look, not the first); a run CRASHED
    for longer than the automation's window is scheduled again, under the attempt cap only.
    (A run of no deployment and a tag of its own: no worker and no automation touch it.)"""
    from datetime import UTC, datetime, timedelta

    import httpx
    from prefect import flow, get_client
    from prefect.states import Pending, Running

    from flowrl.infra import resumer

    assert _status(stack_env)["resumer"]["state"] == "RUNNING"  # a component of the stack

    @flow(name="resumer-probe")
    def probe() -> None: ...

    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that names no process now
    tag = "flowrl-test-resumer"
    with get_client(sync_client=True) as c:
        run = c.create_flow_run(probe, name="resumer-probe", tags=[tag], state=Running())
        c.update_flow_run(run.id, infrastructure_pid=str(gone.pid))
        # One its worker started as it was killed: PENDING, its process gone.
        starting = c.create_flow_run(probe, name="resumer-start", tags=[tag], state=Pending())
        c.update_flow_run(starting.id, infrastructure_pid=str(gone.pid))

    def state_of() -> tuple[str, str, str]:
        with get_client(sync_client=True) as c:
            state = c.read_flow_run(run.id).state
        return state.type.value, state.name, state.message or ""

    with httpx.Client(base_url=stack_env.env["PREFECT_API_URL"], trust_env=False) as api:
        patient = resumer.Resumer(api, tag, max_attempts=3)
        assert patient.one_pass() == []  # gone at a first look: maybe a race, look again
        assert patient.one_pass() == [
            "resumer-probe: RUNNING with its process gone -> CRASHED",
            "resumer-start: PENDING with its process gone -> CRASHED",
        ]
        kind, _, message = state_of()
        assert kind == "CRASHED" and f"pid {gone.pid}" in message, message
        assert patient.one_pass() == []  # within the automation's window: its turn
        with get_client(sync_client=True) as c:
            counts = {
                r.name: r.run_count for r in (c.read_flow_run(run.id), c.read_flow_run(starting.id))
            }
        cap = counts["resumer-probe"]  # the runs under it are scheduled, the others not
        capped = resumer.Resumer(api, tag, max_attempts=cap)
        later = datetime.now(UTC) + timedelta(seconds=resumer.GRACE_SECONDS + 1)
        first = capped.one_pass(now=later)
        assert {line.split(":")[0] for line in first} == {n for n, k in counts.items() if k < cap}
        rest = patient.one_pass(now=later)
    assert all(line.endswith("scheduled again") for line in first + rest), first + rest
    assert len(first + rest) == 2  # each once
    assert state_of()[:2] == ("SCHEDULED", "AwaitingRetry")

    # Seen gone, then scheduled again before the next look (a crash the automation resumed): its
    # new attempt is PENDING with the last attempt's dead pid until its worker writes the new one.
    # That is a first look at a new state, not a second one (a CI run's resumer crashed such an
    # attempt as it started).
    again = f"{tag}-again"
    with get_client(sync_client=True) as c:
        resumed = c.create_flow_run(probe, name="resumer-again", tags=[again], state=Running())
        c.update_flow_run(resumed.id, infrastructure_pid=str(gone.pid))
    with httpx.Client(base_url=stack_env.env["PREFECT_API_URL"], trust_env=False) as api:
        looks = resumer.Resumer(api, again, max_attempts=3)
        assert looks.one_pass() == []
        with get_client(sync_client=True) as c:
            c.set_flow_run_state(resumed.id, Pending(), force=True)
        assert looks.one_pass() == []  # a new state: looked at once
        assert looks.one_pass() == ["resumer-again: PENDING with its process gone -> CRASHED"]


def test_a_job_trains_through_an_mlflow_outage(stack_env):
    """MLflow stopped while a job trains: the job's steps go on (its records wait on disk), it
    waits for MLflow only to register, and it completes once MLflow is back: one MLflow run,
    every step's metrics once, in step order. A job submitted meanwhile says it waits for the
    tracking server (holding no GPU slot), then starts and completes."""
    from flowrl.infra import tracking

    sup = stack_env.supervisord()
    jobs = JobClient()
    config = _small_rl_job("through-outage", OUTAGE_STEPS)
    run_id = jobs.submit("rl-train/rl-train-resume", {"config": config})
    _line(run_id, "RL: steps", 300)
    sup.rpc().stopProcess("mlflow", True)  # stopped by the supervisor: no restart until started
    stopped = time.monotonic()
    try:
        assert _line(run_id, "tracking server unreachable", 120)
        late = jobs.submit("rl-train/rl-train-resume", {"config": _small_rl_job("late", 10)})
        assert _line(late, "waiting for the tracking server at", 120)
        done = _line(run_id, "RL: done", 300)  # every step trained while MLflow was down
        assert _line(run_id, "waiting for MLflow to take", 300)  # after the final evaluation
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - stopped)))
        assert jobs.status(run_id).state == "RUNNING"  # waiting for MLflow, not failed
    finally:
        sup.start("mlflow")
    print(f"\nMLflow down {time.monotonic() - stopped:.0f} s; the job's {done!r} came meanwhile")
    final = jobs.wait(run_id, timeout=600)
    assert final.state == "COMPLETED", final
    assert _line(run_id, "tracking server back after", 10)
    assert jobs.wait(late, timeout=300).state == "COMPLETED"
    assert _line(late, "the tracking server answers after", 10)
    result = jobs.result(run_id)
    client = tracking.client()
    runs = client.search_runs(
        [e.experiment_id for e in client.search_experiments()],
        filter_string="tags.`flowrl.job` = 'through-outage'",
    )
    assert [r.info.run_id for r in runs] == [result["mlflow_run_id"]]
    history = client.get_metric_history(runs[0].info.run_id, "reward/mean")
    assert sorted(m.step for m in history) == list(range(1, OUTAGE_STEPS + 1))  # each once
    ordered = sorted(history, key=lambda m: (m.timestamp, m.step))
    assert [m.step for m in ordered] == sorted(m.step for m in history)  # in step order


def _status(local_stack) -> dict[str, dict]:
    from flowrl.infra import stack

    return stack.component_status(local_stack)


def _restarted(local_stack, name: str, before: int) -> dict | None:
    entry = _status(local_stack)[name]
    return entry if entry["restarts"] > before and entry["state"] == "RUNNING" else None


def _kill_and_wait(local_stack, name: str, pid: int | None = None, timeout_s: float = 180) -> dict:
    """SIGKILL ``name``'s process (or ``pid``, one of its children) and wait until supervisord
    has it RUNNING again and it answers on its own address."""
    from flowrl.infra import stack

    before = _status(local_stack)[name]
    os.kill(pid or before["pid"], signal.SIGKILL)
    began = time.monotonic()
    entry = _wait_for(
        f"{name} restarted", lambda: _restarted(local_stack, name, before["restarts"]), timeout_s
    )
    stack.check_component(local_stack, name, timeout=timeout_s)
    print(f"\n{name}: back {time.monotonic() - began:.1f} s after SIGKILL ({entry['last_reason']})")
    assert entry["url"] == before["url"]  # the same address
    return entry


def _deployment(name: str) -> str:
    """The id of the deployment ``flow/deployment`` in the stack's Prefect database."""
    from prefect import get_client

    with get_client(sync_client=True) as c:
        return str(c.read_deployment_by_name(name).id)


def _tinker_loop_before_a_fault(stack_env):  # noqa: ANN202 - the loop's second half
    """A Tinker SDK training loop on the stack (``tinker-session`` deployed), run to its
    middle; what it returns runs the rest (after a fault) and asserts that its losses are
    those of the same loop run whole beside it, before the fault (the same seed and data)."""
    import tinker
    from tinker import types

    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [1.0] * 4},
        )
    ]

    def steps(tc, n: int) -> list[float]:  # noqa: ANN001
        losses = []
        for _ in range(n):
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(fb.result().metrics["loss:sum"])
        return losses

    def client() -> tinker.ServiceClient:
        url = stack_env.env["TINKER_BASE_URL"]
        return tinker.ServiceClient(base_url=url, api_key="tml-" + "f" * 24)

    whole = client()
    expected = steps(whole.create_lora_training_client("flowrl/tiny", rank=4, seed=0).result(), 6)
    whole.close("success").result()  # its model unloaded: its GPU slot back
    faulted = client()
    tc = faulted.create_lora_training_client("flowrl/tiny", rank=4, seed=0).result()
    losses = steps(tc, 4)

    def rest() -> None:
        losses.extend(steps(tc, 2))
        faulted.close("success").result()
        assert np.allclose(losses, expected, rtol=1e-4), (losses, expected)

    return rest


def test_components_killed_come_back_with_their_data(stack_env, tmp_path):
    """supervisord restarts each component SIGKILLed, on its address, with its data: S3, MLflow,
    PostgreSQL (under Prefect's and MLflow's servers), the Prefect server; the Ray head after
    its GCS dies, and a job submitted then completes, on its first attempt, through a SIGKILL
    of the worker that started it. ``stack status`` says so. The Tinker service, whose Ray
    cluster went with the head, starts again and makes its model again from its journal: an
    SDK loop carries on with the losses it would have had."""
    import mlflow
    import s3fs

    from flowrl.infra.scheduler import RESUME_TAG

    fs = s3fs.S3FileSystem(skip_instance_cache=True)
    fs.pipe("flowrl/faults/before.txt", b"kept")
    mlflow.set_tracking_uri(stack_env.env["FLOWRL_MLFLOW_TRACKING_URI"])
    client = mlflow.MlflowClient()
    experiment = client.create_experiment(f"faults-{time.time_ns()}")
    run = client.create_run(experiment)
    client.log_metric(run.info.run_id, "m", 1.0, step=1)

    _deploy(stack_env, str(REPO), "flowrl.flows.tinker_session.tinker_session", "tinker-session")
    _deploy(stack_env, str(REPO), "flowrl.flows.rl.rl_train", "rl-train-resume", [RESUME_TAG])
    assert "SIGKILL" in _kill_and_wait(stack_env, "s3")["last_reason"]
    assert s3fs.S3FileSystem(skip_instance_cache=True).cat("flowrl/faults/before.txt") == b"kept"
    _kill_and_wait(stack_env, "mlflow")
    assert client.get_metric_history(run.info.run_id, "m")[0].value == 1.0
    _kill_and_wait(stack_env, "postgres")
    _kill_and_wait(stack_env, "prefect")
    assert client.get_run(run.info.run_id).info.run_id == run.info.run_id  # MLflow's database
    assert _deployment("tinker-session/tinker-session")  # Prefect's database, restarted
    gcs = subprocess.run(
        ["pgrep", "-f", "gcs_server", "-g", str(_status(stack_env)["ray"]["pid"])],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert gcs, "no gcs_server in the Ray head's process group"
    tinker_loop, tinker_before = (
        _tinker_loop_before_a_fault(stack_env),
        _status(stack_env)["tinker"],
    )
    _kill_and_wait(stack_env, "ray", pid=int(gcs[0]))
    tinker_loop()  # the Tinker service made its model again; its loop carried on, exactly
    tinker_after = _status(stack_env)["tinker"]
    assert tinker_after["restarts"] == tinker_before["restarts"] + 1, tinker_after
    out = _flowrl("stack", "status", cwd=tmp_path, env=_client_env())
    assert out.returncode == 0, out.stdout + out.stderr  # everything RUNNING again
    for name in ("s3", "mlflow", "postgres", "prefect", "ray"):
        line = next(x for x in out.stdout.splitlines() if x.startswith(name + " "))
        assert line.split()[3] == "1", line  # one restart each, in the restarts column
    jobs = JobClient()
    run_id = jobs.submit("rl-train/rl-train-resume", {"config": _small_rl_job("after-ray", 40)})
    _line(run_id, "RL: steps", 300)
    _kill_and_wait(stack_env, "worker")  # its running job is not its child's pipe: it goes on
    final = jobs.wait(run_id, timeout=300)
    assert (final.state, final.attempts) == ("COMPLETED", 1), final


def test_stack_down_then_up_loses_nothing(local_stack, monkeypatch, tmp_path):
    """``stack down`` stops every process (the supervisor, then each component); ``stack up``
    in the same home brings back every earlier job's checkpoints, its registered version (whose
    artifacts load in transformers), the Prefect runs and MLflow runs, on PostgreSQL; no log
    of the whole module's run has a "database is locked"."""
    import s3fs
    from transformers import AutoModelForCausalLM

    from flowrl.backends.models.model_uri import resolve_model_uri
    from flowrl.infra import stack, tracking
    from flowrl.infra.storage import Storage, load_latest_checkpoint

    home = Path(local_stack.env["FLOWRL_HOME"])
    logs = list((home / "stack").glob("*.log"))
    assert logs and not [p.name for p in logs if "database is locked" in p.read_text()]
    monkeypatch.setenv("FLOWRL_HOME", str(home))
    monkeypatch.setenv("FLOWRL_SCHEDULER_FILE", local_stack.env["FLOWRL_SCHEDULER_FILE"])
    for key in ("PREFECT_API_URL", "FLOWRL_PREFECT_API_URL"):
        monkeypatch.delenv(key, raising=False)
    pids = [int(local_stack.supervisor["pid"])]
    pids += [e["pid"] for e in stack.component_status(local_stack).values()]
    assert stack.stack_down() == list(stack.STOP_ORDER)
    for pid in pids:
        assert not stack._alive(pid), pid
    assert not stack.state_file().exists()
    assert stack.read_pointer() != stack.state_file()  # no pointer left to the stopped stack

    again = stack.stack_up(gpus=2, deploy=False, ray=False)
    try:
        for key, value in again.env.items():
            monkeypatch.setenv(key, value)
        storage = Storage(again.env["FLOWRL_STORAGE_URL"])
        step, files, _ = load_latest_checkpoint(storage, f"jobs/{RESUME_JOB}/checkpoints")
        assert step == RESUME_STEPS and files  # the resumed job's last checkpoint, intact
        assert s3fs.S3FileSystem(skip_instance_cache=True).cat("flowrl/faults/before.txt")
        version = tracking.download_model(f"models:/{RESUME_JOB}/1")
        assert (Path(version) / "MLmodel").exists()  # an MLflow Model, as registered
        folder = resolve_model_uri(f"models:/{RESUME_JOB}/1", str(tmp_path))
        model = AutoModelForCausalLM.from_pretrained(folder)
        assert model.num_parameters() > 0  # the registered version's artifacts load
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: again.env["PREFECT_API_URL"]}):
            names = {j.name for j in JobClient().list(limit=200)}
        assert RESUME_JOB in names  # Prefect's runs, from its database
    finally:
        stack.stack_down()
