"""``env.step_timeout_s``: a user's environment whose ``reset`` or ``step`` never returns fails
that episode alone, with the reason, in every mode (in-process, Ray actors, the HTTP service on
loopback), and the others finish; what the hung call held is given back where it can be (the Ray
actor is killed and replaced, the service drops the episode). One real ``rl-train`` job with one
hung episode in 16 finishes and counts it. And the service's episode table holds its per-owner
limit under concurrent resets."""

from __future__ import annotations

import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import ray
from fakes import ByteChat, say
from hangs import HUNG
from services import start_env_service

from flowrl.agent_loop.loop import LoopLimits, run_episodes
from flowrl.agent_loop.types import SampleResult, StopReason
from flowrl.environments.remote import EnvFactory, stop_env_pool
from flowrl.environments.timeouts import EnvCall, Failed, call_all
from flowrl.tasks.episodes import episode_metrics

TIMEOUT_S = 2.0
MODES = ("local", "ray", "http")


class SaysOk:
    def sample(self, prompts, max_new_tokens, temperature, images=None):
        return [SampleResult(say("ok"), [-0.1] * len(say("ok")), "stop") for _ in prompts]


@pytest.fixture(scope="module")
def env_service():
    """The service serving the hanging environment; stopped by PID."""
    url, proc = start_env_service(HUNG)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def local_ray(ray_local):
    """The session's Ray (conftest)."""


def _factory(mode: str, job: str, url: str) -> EnvFactory:
    return EnvFactory(
        HUNG, {}, mode, job=job, service_url=url, ray_actors=2, step_timeout_s=TIMEOUT_S
    )


def _play(factory: EnvFactory, rows: list[dict]) -> tuple[list, float]:
    """The episodes of ``rows`` through the agent loop; (trajectories, seconds)."""
    ids = [f"ep-{i}" for i in range(len(rows))]
    start = time.perf_counter()
    try:
        envs = [factory(i) for i in ids]
        limits = LoopLimits(max_turns=1, max_new_tokens=4, max_context_tokens=128)
        out = run_episodes(envs, rows, list(range(len(rows))), SaysOk(), ByteChat(), limits, ids)
    finally:
        factory.close()
    return out, time.perf_counter() - start


@pytest.mark.parametrize("verb", ["reset", "step"])
@pytest.mark.parametrize("mode", MODES)
def test_a_hung_call_fails_its_episode_alone_with_the_reason(mode, verb, env_service, local_ray):
    rows = [{"seed": i} for i in range(6)]
    rows[2]["hang"] = verb
    trajectories, seconds = _play(_factory(mode, f"hang-{verb}", env_service), rows)

    hung, others = trajectories[2], trajectories[:2] + trajectories[3:]
    assert hung.stop_reason is StopReason.ERROR
    assert f"{verb} timed out after 2 s" in hung.info["error"], hung.info
    assert all(t.stop_reason is StopReason.DONE and t.reward == 1.0 for t in others)
    assert episode_metrics(trajectories, "env")["env/stop_error"] == pytest.approx(1 / 6)
    assert seconds < TIMEOUT_S + 8, seconds  # waited for the deadline once, not forever
    if mode == "ray":
        stop_env_pool(f"hang-{verb}-envs", 2)


@pytest.mark.parametrize("verb", ["reset", "step"])
@pytest.mark.parametrize("mode", ("local", "http"))
def test_k_hung_calls_in_a_round_cost_about_one_timeout(mode, verb, env_service):
    """Four of eight episodes hang in the same round: their waits run side by side, so the
    round takes about one timeout (k timeouts one after another would be 8 s)."""
    rows = [{"seed": i} | ({"hang": verb} if i % 2 else {}) for i in range(8)]
    trajectories, seconds = _play(_factory(mode, f"hang-k-{verb}", env_service), rows)

    hung = [t for i, t in enumerate(trajectories) if i % 2]
    assert all(f"{verb} timed out after 2 s" in t.info["error"] for t in hung)
    assert all(t.stop_reason is StopReason.DONE for i, t in enumerate(trajectories) if i % 2 == 0)
    assert seconds < 2 * TIMEOUT_S + 1.5, seconds


def test_calls_that_return_at_once_run_in_order_on_one_thread():
    """Fast calls keep their order (an environment sharing state between episodes sees what
    it saw before) and cost no thread each; a raising call is handed back, not raised."""
    order, threads = [], set()

    def call(i: int):
        order.append(i)
        threads.add(threading.get_ident())
        if i == 3:
            raise ValueError("bad row")
        return i * i

    calls = [EnvCall(lambda i=i: call(i), 1.0, "step") for i in range(50)]
    results = call_all(calls)

    assert order == list(range(50)) and len(threads) == 1
    assert isinstance(results[3], Failed) and str(results[3].error) == "bad row"
    assert [r for i, r in enumerate(results) if i != 3] == [i * i for i in range(50) if i != 3]


def test_ray_kills_the_hung_actor_and_the_pool_serves_on(local_ray):
    factory = _factory("ray", "hang-pool", "")
    hung_actor = factory._actors[zlib.crc32(b"ep-0") % 2]  # the actor hosting episode ep-0
    _play(factory, [{"seed": 0, "hang": "step"}, {"seed": 1}, {"seed": 2}])

    with pytest.raises(ray.exceptions.RayActorError):  # the hung call's process is gone
        ray.get(hung_actor.live.remote(), timeout=30)
    again, seconds = _play(_factory("ray", "hang-pool", ""), [{"seed": s} for s in range(4)])
    assert all(t.stop_reason is StopReason.DONE for t in again)  # a fresh actor in its place
    assert seconds < TIMEOUT_S
    stop_env_pool("hang-pool-envs", 2)


def test_the_service_drops_a_timed_out_episode_and_answers_504(env_service):
    with httpx.Client(base_url=env_service, timeout=30) as c:
        body = {"job": "drop", "episode_id": "e", "env": {"name": HUNG}, "row": {"hang": "step"}}
        assert c.post("/reset", json=body | {"step_timeout_s": 1}).status_code == 200
        assert c.get("/stats").json()["jobs"].get("drop") == 1
        answer = c.post("/step", json={"job": "drop", "episode_id": "e", "action": "ok"})
        assert answer.status_code == 504 and "step timed out after 1 s" in answer.text
        assert c.get("/stats").json()["jobs"].get("drop", 0) == 0  # the slot is free
        late = c.post("/step", json={"job": "drop", "episode_id": "e", "action": "ok"})
        assert late.status_code == 404


# --- the episode table under concurrent resets -----------------------------------------------

LIMIT, CALLERS = 3, 16


def test_concurrent_resets_never_pass_the_per_owner_limit():
    """16 resets at once against one owner allowed 3 live episodes, each reset slow enough
    (0.3 s) for all of them to be in flight together: exactly 3 succeed, the rest get 429,
    the service's own count never passes 3, and the service keeps serving."""
    options = ("--insecure-loopback", "--max-episodes-per-namespace", str(LIMIT))
    url, proc = start_env_service(HUNG, options=options)
    seen: list[int] = []
    stop = threading.Event()

    def watch() -> None:
        with httpx.Client(base_url=url, timeout=30) as c:
            while not stop.is_set():
                seen.append(c.get("/stats").json()["episodes"])

    def reset(i: int) -> int:
        slow = {"name": HUNG, "params": {"delay_s": 0.3}}
        body = {"job": "load", "episode_id": f"e{i}", "env": slow, "row": {"seed": i}}
        with httpx.Client(base_url=url, timeout=60) as c:
            return c.post("/reset", json=body).status_code

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(CALLERS) as pool:
            codes = list(pool.map(reset, range(CALLERS)))
        stop.set()
        watcher.join(timeout=30)
        with httpx.Client(base_url=url, timeout=30) as c:
            final = c.get("/stats").json()
            assert c.get("/health").json() == {"status": "ok"}
            ended = c.delete(f"/episodes/load/e{codes.index(200)}").status_code
            body = {"job": "load", "episode_id": "new", "env": {"name": HUNG}, "row": {}}
            again = c.post("/reset", json=body)
    finally:
        stop.set()
        proc.terminate()
        proc.wait(timeout=10)
    assert codes.count(200) == LIMIT and codes.count(429) == CALLERS - LIMIT, codes
    assert final["episodes"] == LIMIT
    assert seen and max(seen) <= LIMIT, seen
    assert ended == 200 and again.status_code == 200  # a freed slot is taken again


# --- one real job -----------------------------------------------------------------------------


def test_a_job_with_one_hung_episode_in_16_finishes_and_counts_it(
    prefect_api, flowrl_home, tmp_path
):
    """``rl-train`` (local mode, 2 steps of 4 rows x 4 episodes) whose environment hangs in
    ``step`` for one episode of each step: the job finishes, and each step's rollout counts one
    failed episode of 16."""
    from flowrl.flows.rl import rl_train
    from flowrl.infra.tracking import client
    from flowrl.tasks.schemas import load_job

    config = load_job(
        None,
        [
            "name=hang-e2e",
            f"env.name={HUNG}",
            "env.params.hang_every=4",
            f"env.params.claims={tmp_path}",
            f"env.step_timeout_s={TIMEOUT_S}",
            "env.eval_size=4",
            "warmup.enabled=false",
            "rollout.prompts_per_step=4",
            "rollout.group_size=4",
            "rollout.max_new_tokens=4",
            "schedule.steps=2",
            "schedule.eval_every=2",
            "schedule.checkpoint_every=2",
        ],
    )
    start = time.perf_counter()
    result = rl_train(config)
    seconds = time.perf_counter() - start

    history = client().get_metric_history(result.mlflow_run_id, "rollout/failed_episodes")
    assert [m.value for m in history] == [1.0, 1.0]  # both steps, one failed episode each
    errors = client().get_metric_history(result.mlflow_run_id, "env/stop_error")
    assert [m.value for m in errors] == [pytest.approx(1 / 16)] * 2
    assert len(list(tmp_path.iterdir())) == 2  # one hang claimed per step
    assert seconds < 2 * (TIMEOUT_S + 60), seconds  # bounded: nothing waited forever


def test_a_hung_reset_fails_the_config_check_naming_the_timeout():
    """The config check's one ``reset`` has the job's deadline too: a bad config fails before
    the job starts instead of hanging it."""
    import pydantic

    from flowrl.tasks.schemas import RLJobConfig

    started = time.monotonic()
    with pytest.raises(pydantic.ValidationError, match=r"reset timed out after 0.5 s"):
        RLJobConfig.model_validate(
            {"env": {"name": HUNG, "params": {"delay_s": 30.0}, "step_timeout_s": 0.5}}
        )
    assert time.monotonic() - started < 10
