"""Environments in-process, as a pool of Ray actors, and behind the HTTP service (on loopback):
the same episode gives the same trajectory in all three modes, and a service killed mid-run
fails its episodes cleanly while the loop goes on."""

from __future__ import annotations

import zlib
from dataclasses import asdict

import pytest
from fakes import ByteChat, say
from services import start_env_service

from flowrl.agent_loop.loop import LoopLimits, run_episodes
from flowrl.agent_loop.types import SampleResult, StopReason
from flowrl.environments.registry import make_task
from flowrl.environments.remote import EnvFactory, stop_env_pool

GOMOKU = {"size": 3, "win_length": 3, "move_format": "cell", "max_policy_turns": 9}
MOVES = ["5", "1", "9", "3", "7", "2", "4", "6", "8", "5x"]  # the last one is invalid
GEOMETRY = {"num_choices": 9 - 5, "image_size": 16}  # rows and shown images carry PNG bytes


class PromptHashPolicy:
    """A deterministic fake policy: the move is a function of the whole prompt so far."""

    def __init__(self, on_call=None):
        self.calls = 0
        self.on_call = on_call

    def sample(self, prompts, max_new_tokens, temperature, images=None):
        self.calls += 1
        if self.on_call is not None:
            self.on_call(self.calls)
        out = []
        for prompt in prompts:
            move = MOVES[zlib.crc32(bytes(t % 256 for t in prompt)) % len(MOVES)]
            tokens = say(move)[:max_new_tokens]
            out.append(SampleResult(tokens, [-0.5] * len(tokens), "stop"))
        return out


@pytest.fixture(scope="module")
def env_service():
    """The environment service for the module; stopped by PID."""
    url, proc = start_env_service()
    yield url, proc
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(scope="module")
def local_ray(ray_local):
    """The session's Ray (conftest)."""


def _play(factory, rows, policy=None, max_turns=9):
    ids = [f"ep-{i}" for i in range(len(rows))]
    envs = [factory(i) for i in ids]
    limits = LoopLimits(max_turns=max_turns, max_new_tokens=4, max_context_tokens=512)
    policy = policy or PromptHashPolicy()
    try:
        return run_episodes(envs, rows, list(range(len(rows))), policy, ByteChat(), limits, ids)
    finally:
        factory.close()


def _comparable(trajectories):
    return [
        {k: v for k, v in asdict(t).items() if k != "info"} | {"info": {**t.info}}
        for t in trajectories
    ]


@pytest.mark.parametrize(
    ("name", "params", "max_turns"),
    [("gomoku", GOMOKU, 9), ("arithmetic", {}, 1), ("geometry", GEOMETRY, 1)],
)
def test_same_episode_same_trajectory_in_all_modes(env_service, local_ray, name, params, max_turns):
    task = make_task(name, params)
    rows = task.eval_set()[:6]
    url, _ = env_service
    runs = {
        "local": _play(EnvFactory(name, params, "local"), rows, max_turns=max_turns),
        "ray": _play(EnvFactory(name, params, "ray", job="t"), rows, max_turns=max_turns),
        "http": _play(
            EnvFactory(name, params, "http", job="t", service_url=url), rows, max_turns=max_turns
        ),
    }
    stop_env_pool("t-envs", 2)
    assert all(t.stop_reason is not StopReason.ERROR for t in runs["local"])
    assert _comparable(runs["ray"]) == _comparable(runs["local"])
    assert _comparable(runs["http"]) == _comparable(runs["local"])
    if name == "gomoku":  # multi-turn games really happened
        assert max(len(t.turn_rewards) for t in runs["local"]) >= 3
    if name == "geometry":  # the figures made it through every mode
        assert all(t.images == row["images"] for t, row in zip(runs["http"], rows, strict=True))


def test_http_service_frees_episodes_and_reports_stats(env_service):
    import httpx

    url, _ = env_service
    _play(EnvFactory("gomoku", GOMOKU, "http", job="stats", service_url=url), [{"seed": "s"}] * 3)
    stats = httpx.get(f"{url}/stats").json()
    assert stats["jobs"].get("stats", 0) == 0  # every episode ended or was freed by close()
    assert stats["steps"] > 0


@pytest.mark.parametrize("name", ["__import__('os')", "os:system", "subprocess:Popen", "chess"])
def test_a_name_the_service_does_not_serve_is_refused_as_data_not_code(env_service, name):
    """A client names an environment; the service builds only those it serves (here, with no
    --env, the installed ones): an importable ``module:attribute`` is refused, not imported."""
    import httpx

    url, _ = env_service
    body = {"job": "j", "episode_id": "e", "env": {"name": name}, "row": {"command": "id"}}
    answer = httpx.post(f"{url}/reset", json=body)
    assert answer.status_code == 403 and "is not served here" in answer.text, answer.text
    assert "tool_math" in answer.text  # the refusal lists what is served


@pytest.mark.parametrize(
    "image",
    [
        "/etc/passwd",
        "../../../../etc/passwd",
        "/proc/self/environ",
        "file:///etc/passwd",
        "http://127.0.0.1:9/secret",
        {"bytes": None, "path": "/etc/passwd"},
    ],
)
def test_a_row_naming_a_file_is_refused_and_nothing_is_read(env_service, image):
    """The service never opens a path or URL that arrives in a row: a clean 400 naming why,
    and no byte of the file in the answer."""
    import httpx

    url, _ = env_service
    row = {"problem": "p", "answer": "1", "images": [image]}
    body = {"job": "j", "episode_id": "files", "env": {"name": "geometry"}, "row": row}
    answer = httpx.post(f"{url}/reset", json=body)
    assert answer.status_code == 400, answer.text
    assert "must be bytes" in answer.text
    assert "root:" not in answer.text and "AWS_" not in answer.text


def test_killing_the_service_mid_run_fails_episodes_cleanly():
    """The loop returns; the episodes that needed the dead service end with ERROR, counted."""
    url, proc = start_env_service()

    def kill_after_first_round(call: int) -> None:
        if call == 2:
            proc.kill()
            proc.wait(timeout=10)

    factory = EnvFactory("gomoku", GOMOKU, "http", job="kill", service_url=url, timeout_s=5)
    rows = make_task("gomoku", GOMOKU).eval_set()[:8]
    trajectories = _play(factory, rows, PromptHashPolicy(on_call=kill_after_first_round))
    failed = [t for t in trajectories if t.stop_reason is StopReason.ERROR]
    assert failed, "games still running when the service died must fail"
    assert all("environment service unreachable" in t.info["error"] for t in failed)
    assert all(len(t.turn_rewards) >= 1 for t in trajectories)  # the first round was played

    from flowrl.tasks.episodes import episode_metrics

    metrics = episode_metrics(trajectories, "env")
    assert metrics["env/stop_error"] == pytest.approx(len(failed) / len(trajectories))


def test_http_mode_needs_a_service_url():
    from flowrl.infra.configfile import ConfigError
    from flowrl.tasks.schemas import load_job

    with pytest.raises(ConfigError, match="service_url"):
        load_job(None, ["env.mode=http"])
