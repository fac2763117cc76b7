"""The local stack for real (moto S3, MLflow server, Prefect server + process worker, Ray head)
and the scheduler under load, judged by Prefect's own flow-run state history.

Load test: 12 probe jobs submitted at once to queues `lo` (limit 1, priority 2; submitted
first) and `hi` (limit 2, priority 1), pool limit 2, 2 GPU slots, jobs holding 1 or 2 slots.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from flowrl.infra.client import JobClient

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[1]
PROBE = "gpu-probe/gpu-probe"


@pytest.fixture(scope="module")
def probe_deployment(local_stack):
    """The gpu-probe flow deployed from this checkout on the test pool (default queue hi)."""
    from prefect.flows import Flow
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flowrl.infra.scheduler import load_scheduler

    os.environ["FLOWRL_SCHEDULER_FILE"] = local_stack.env["FLOWRL_SCHEDULER_FILE"]
    try:
        pool = load_scheduler().pool.name
    finally:
        os.environ.pop("FLOWRL_SCHEDULER_FILE")
    with temporary_settings(updates={PREFECT_API_URL: local_stack.env["PREFECT_API_URL"]}):
        Flow.from_source(str(REPO), "flowrl.flows.probe.gpu_probe").deploy(
            "gpu-probe",
            work_pool_name=pool,
            work_queue_name="hi",
            build=False,
            push=False,
            print_next_steps=False,
            ignore_warnings=True,
        )
    return PROBE


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


def test_a_job_larger_than_the_pool_is_refused_by_the_cli(stack_env, monkeypatch, capsys):
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
    tol = 0.5
    overtaken = 0
    for queue, _, start, _ in runs.values():
        if queue != "lo":
            continue
        hi_waiting = [r for r in runs.values() if r[0] == "hi" and r[1] < start - tol < r[2] - tol]
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


def test_stack_down_stops_every_process(local_stack, monkeypatch):
    from flowrl.infra import stack

    monkeypatch.setenv("FLOWRL_HOME", local_stack.env["FLOWRL_HOME"])
    assert stack.stack_down() == list(stack.STOP_ORDER)
    for comp in local_stack.components.values():
        assert not stack._alive(comp.pid)
    assert not stack.state_file().exists()
