"""A user's own game between agents: the worked example of docs/environments.md
(``examples/nim``) loads by ``module:Class``, trains by self-play with ``flowrl selfplay``, and
is seen from one side against its reference player by every evaluation (and by ``rl-train``)."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError
from services import run_flowrl

from flowrl.environments.games import PLAY_AS, GameTask, VersusOpponent
from flowrl.environments.registry import EnvironmentLoadError, load, make_games, make_task
from flowrl.tasks.schemas import SelfPlayJobConfig, load_job

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "nim"
NIM = "nim_env:Nim"


@pytest.fixture(scope="module", autouse=True)
def on_path(tmp_path_factory: pytest.TempPathFactory):
    """The example folder and a folder of broken games on this process's path."""
    bad = tmp_path_factory.mktemp("bad-games")
    (bad / "my_bad_games.py").write_text(
        textwrap.dedent(
            """
            from nim_env import Nim

            class NoReference(Nim):
                opponent_move = None

            class OnePlayer(Nim):
                agents = ("solo",)

            class Twins(Nim):
                agents = ("a", "a")

            class BadName(Nim):
                agents = ("first", "../second")

            class ResetRaises(Nim):
                def reset(self, seed, **_):
                    raise KeyError("no pile in the row")
            """
        )
    )
    sys.path[:0] = [str(EXAMPLE), str(bad)]
    yield
    sys.path.remove(str(EXAMPLE))
    sys.path.remove(str(bad))


def test_a_game_class_loads_as_a_game_and_rl_sees_it_from_one_side():
    loaded = load(NIM)
    assert loaded.is_game and not loaded.is_task_config
    task = make_task(NIM, {"low": 5, "high": 5})
    assert isinstance(task, GameTask) and task.agents == ("first", "second")
    env = task.make_env()
    assert isinstance(env, VersusOpponent)
    # The policy plays second: the reference player has opened (5 -> 4, its winning move 1).
    first = env.reset(seed=3, **{PLAY_AS: "second"})
    assert first.endswith("Stones: 4.") and env.side == "second"
    assert "Take 1, 2 or 3" in env.get_system_prompt()
    done = env.step("3")  # 4 -> 1; the reference takes the last stone
    assert done.done and done.info["win"] == 0 and done.reward == -1.0


def test_the_policy_winning_gets_the_outcome_and_hostile_text_is_an_invalid_move():
    env = make_task(NIM, {"low": 7, "high": 7, "mistake": 0.0}).make_env()
    env.reset(seed=0, **{PLAY_AS: "first"})
    for text in ("", "4", "three", "1; import os", "\x00" * 50):
        step = env.step(text) if text != "4" else None
        if step is not None:
            break
    assert step is not None and step.reward == -0.5 and "Invalid" in step.observation
    env.reset(seed=0, **{PLAY_AS: "first"})
    won = env.step("3")  # 7 -> 4: a multiple of four; the reference cannot win
    while not won.done:
        pile = int(won.observation.split("Stones: ")[1].rstrip("."))
        won = env.step(str(pile % 4))
    assert won.info == {"invalid_moves": 0, "win": 1, "outcome": 1.0} and won.reward == 1.0


def test_rows_openings_and_sides():
    games = make_games(NIM, {}, eval_size=6, seed=2)
    assert games.openings(3, 4) == games.openings(3, 4)  # a pure function of the step
    assert games.openings(3, 4) != games.openings(4, 4)
    train = {r["seed"] for step in range(5) for r in games.openings(step, 8)}
    assert train.isdisjoint(range(6))  # held-out seeds never reach self-play or training
    assert [r[PLAY_AS] for r in games.eval_set()] == ["first", "second"] * 3
    assert {r[PLAY_AS] for r in games.versus(("second",)).eval_set()} == {"second"}
    assert len(games.head_to_head_rows()) == 2


def test_warmup_imitates_the_reference_player_through_the_game():
    task = make_task(NIM, {"mistake": 0.0})
    messages = task.sft_example({"seed": 11, PLAY_AS: "first"})
    assert messages[0]["role"] == "system" and messages[1]["content"].startswith("Stones: ")
    moves = [m["content"] for m in messages if m["role"] == "assistant"]
    assert moves and all(m in ("1", "2", "3") for m in moves)


def test_self_play_accepts_a_game_and_refuses_an_environment_that_is_not_one():
    config = load_job(str(EXAMPLE / "nim.yaml"), [], kind=SelfPlayJobConfig)
    assert config.agents == ("first", "second")
    assert SelfPlayJobConfig().agents == ("X", "O")  # flowrl's Gomoku
    with pytest.raises(ValidationError, match="is not a game between agents"):
        SelfPlayJobConfig(env={"name": "arithmetic"})


@pytest.mark.parametrize(
    ("name", "cause"),
    [
        ("my_bad_games:NoReference", "lacks method(s) opponent_move"),
        ("my_bad_games:OnePlayer", "two or more agent names"),
        ("my_bad_games:Twins", "must be distinct"),
        ("my_bad_games:BadName", "agent names must match"),
    ],
)
def test_a_bad_game_is_named_when_it_loads(name, cause):
    with pytest.raises(EnvironmentLoadError, match=cause.replace("(", r"\(").replace(")", r"\)")):
        load(name)


def test_a_game_whose_reset_raises_fails_the_config_naming_it():
    with pytest.raises(ValidationError, match="no pile in the row"):
        SelfPlayJobConfig(env={"name": "my_bad_games:ResetRaises"})


def test_flowrl_selfplay_trains_the_readme_game(tmp_path):
    """The guide's command (shortened), on a machine with nothing configured (Prefect's
    embedded ephemeral API, a local Ray): warm-up on the reference player's moves, self-play
    between two policies, each registered under its agent's name; the warm-up lifts the win
    share against the reference player and self-play keeps both policies playing legal moves."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(EXAMPLE), env.get("PYTHONPATH", "")])
    env["FLOWRL_HOME"] = str(tmp_path / "home")
    overrides = ["schedule.steps=6", "schedule.eval_every=6", "schedule.checkpoint_every=6"]
    done = run_flowrl("selfplay", EXAMPLE / "nim.yaml", overrides, env, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'home' / 'mlflow.db'}")
    for agent in ("first", "second"):
        versions = client.search_model_versions(f"name='nim-selfplay-{agent}'")
        assert [str(v.version) for v in versions] == ["1"]
    run = client.search_runs(client.get_experiment_by_name("flowrl").experiment_id)[0]
    metrics = run.data.metrics
    assert metrics["h2h/first_wins"] + metrics["h2h/second_wins"] + metrics["h2h/draws"] == 2
    for agent in ("first", "second"):
        assert metrics[f"eval/{agent}/accuracy"] > 0.0  # it beats the reference player sometimes
        invalid = client.get_metric_history(run.info.run_id, f"agent-{agent}/invalid_moves")
        assert len(invalid) == 6
