"""TextArena's games as flowrl games by name (``env.name: textarena:<Game-v0>``), with the real
library (the ``envs`` extra, part of ``dev``): the players are the agents, the game's messages
their user turns, ``close()``'s rewards the outcome, invalid moves counted from the game's own
signal, and a game that cannot run here refused before a job starts."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import textarena  # noqa: F401 - the real library (the envs extra): never skipped
from pydantic import ValidationError

from flowrl.cli import main
from flowrl.environments import textarena as ta_env
from flowrl.environments.games import PLAY_AS, VersusOpponent, winner
from flowrl.environments.registry import EnvironmentLoadError, load, make_games, make_task
from flowrl.tasks.schemas import SelfPlayJobConfig, load_job

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "tictactoe-selfplay.yaml"
P0, P1 = ta_env.AGENTS


def _game(name: str, **params):
    return load(f"textarena:{name}").target(**params)


def _play_out(game, seed: int) -> list[str]:
    """One game with the reference player on both sides; the moves, in order."""
    game.reset(seed=seed)
    moves = []
    while (agent := game.current_agent()) is not None:
        moves.append(game.opponent_move(agent))
        game.act(agent, moves[-1])
        assert len(moves) < 500
    return moves


@pytest.mark.parametrize("name", ["TicTacToe-v0", "ConnectFour-v0", "Nim-v0", "KuhnPoker-v0"])
def test_reference_players_play_whole_games_and_close_gives_the_outcome(name):
    loaded = load(f"textarena:{name}")
    assert loaded.is_game and not loaded.is_task_config
    assert loaded.target.agents == ("Player0", "Player1")
    game = loaded.target()
    outcomes = []
    for seed in range(12):
        moves = _play_out(game, seed)
        finals = game.final_rewards()
        rewards, _ = game.env.close()  # TextArena's own outcome
        assert finals == {P0: float(rewards[0]), P1: float(rewards[1])}
        assert sum(finals.values()) == 0 and set(finals.values()) <= {-1.0, 0.0, 1.0}
        assert game.invalid == {P0: 0, P1: 0}  # the reference player only plays legal moves
        assert _play_out(game, seed) == moves  # a game row is deterministic in its seed
        outcomes.append(winner(finals))
    assert {P0, P1} <= set(outcomes)  # random legal play: each side wins some games


def test_the_game_prompt_is_the_system_prompt_and_its_messages_are_user_turns():
    game = _game("TicTacToe-v0")
    game.reset(seed=0)
    assert game.current_agent() == P0
    assert game.get_system_prompt(P0).startswith("You are Player 0 in Tic Tac Toe")
    assert game.get_system_prompt(P1).startswith("You are Player 1 in Tic Tac Toe")
    first = game.observation(P0)
    assert "Available Moves: '[0]'" in first and "You are" not in first
    assert game.observation(P0) == first  # asking twice shows the same turn
    moved = game.act(P0, "[4]")
    assert not moved.done and moved.info["invalid_moves"] == 0
    seen = game.observation(P1)  # everything since Player1's last move, as TextArena sends it
    assert "[Player 0] [4]" in seen and "placed their symbol (O) in cell 4" in seen
    assert "'[4]'" not in seen.rsplit("Available Moves", 1)[1]
    board = _game("TicTacToe-v0", view="board", system_prompt="Reply [n].")
    board.reset(seed=0)
    board.act(P0, "[4]")
    assert board.observation(P1).startswith("Current Board:") and "[Player 0]" not in (
        board.observation(P1)
    )
    assert board.get_system_prompt(P1) == "Reply [n]."


def test_invalid_moves_are_counted_from_the_game_and_a_second_one_forfeits():
    game = _game("TicTacToe-v0", invalid_move_reward=-0.5)
    game.reset(seed=0)
    game.act(P0, "[4]")
    taken = game.act(P1, "I take the centre: [4]")  # occupied: TextArena's own rule
    assert taken.reward == -0.5 and not taken.done
    assert taken.info["invalid_moves"] == 1 and taken.info["invalid_rate"] == 1.0
    assert game.current_agent() == P1  # one retry, told why
    assert "cell 4 is already occupied" in game.observation(P1)
    ok = game.act(P1, "[0]")
    assert ok.reward == 0.0 and ok.info["invalid_rate"] == 0.5
    game.act(P0, "[8]")
    game.act(P1, "no move at all")
    hostile = game.act(P1, "[1]" * 5000)  # too long: the empty move, invalid by the rules
    assert hostile.done and hostile.info["invalid_moves"] == 3
    assert game.final_rewards() == {P0: 1.0, P1: -1.0}  # forfeit: close()'s rewards
    assert game.current_agent() is None
    nim = _game("Nim-v0")
    nim.reset(seed=0)
    assert nim.act(P0, "[0 99]").info["invalid_moves"] == 1  # more than the pile holds
    assert nim.act(P0, "[0 3]").info["invalid_moves"] == 1
    assert nim.current_agent() == P1


def test_rl_sees_a_game_from_one_side_and_warmup_imitates_the_reference_player():
    task = make_task("textarena:TicTacToe-v0", {"view": "board"}, eval_size=4)
    rows = task.eval_set()
    assert [r[PLAY_AS] for r in rows] == [P0, P1, P0, P1]
    messages = task.sft_example(rows[1])
    assert messages[0]["content"].startswith("You are Player 1")
    moves = [m["content"] for m in messages if m["role"] == "assistant"]
    assert moves and all(m in {f"[{i}]" for i in range(9)} for m in moves)
    env = task.make_env()
    assert isinstance(env, VersusOpponent)
    env.reset(**rows[0])
    while True:
        result = env.step(env.game.opponent_move(env.side))
        if result.done:
            break
    assert result.info["outcome"] in (-1.0, 0.0, 1.0) and result.info["invalid_moves"] == 0
    assert result.info["win"] == int(result.info["outcome"] == 1.0)  # whoever ended the game
    games = make_games("textarena:Nim-v0", {}, eval_size=4)
    assert games.agents == (P0, P1) and len(games.openings(0, 3)) == 3


def test_warmup_skips_rows_whose_game_ends_before_the_policy_moves():
    """One hand of poker: the reference player may fold before the policy's side acts; that
    row has no demonstration (and cannot be played against the reference), and warm-up's
    batches skip it instead of failing the job."""
    from flowrl.environments.types import NoDemonstration
    from flowrl.tasks.model import _demonstrations

    config = load_job(
        None,
        ["env.name=textarena:Poker-v0", "env.params={num_rounds: 1}", "env.eval_size=4"],
        SelfPlayJobConfig,
    )
    task = config.env.task(config.seed)
    outcomes = []
    for row in task.train_source().next_batch(12):
        try:
            outcomes.append(len(task.sft_example(row)) > 1)
        except NoDemonstration as err:
            assert "ended before the policy's first move" in str(err)
            outcomes.append(False)
    assert True in outcomes and False in outcomes  # both kinds among these rows
    batch = _demonstrations(config, task)(8)
    assert len(batch) == 8
    assert all(m[-1]["role"] == "assistant" and m[-1]["content"] for m in batch)


def test_an_unknown_game_lists_the_nearest_names():
    with pytest.raises(EnvironmentLoadError) as err:
        load("textarena:TicTacToe")
    message = str(err.value)
    assert "unknown TextArena game 'TicTacToe'" in message and "nearest: TicTacToe-v0" in message


@pytest.mark.parametrize(
    ("name", "cause"),
    [
        ("Wordle-v0", "needs NLTK data 'words', which is not installed"),
        ("Chess-v0", "does not import (textarena.envs.Chess.env): SyntaxError"),
        ("Sudoku-v0", "does not play with 2 players"),
        ("Battleship-v0", "has no reference player in flowrl"),
    ],
)
def test_a_game_that_cannot_run_here_is_named_with_the_reason(name, cause):
    with pytest.raises(EnvironmentLoadError) as err:
        load(f"textarena:{name}")
    assert f"TextArena game {name!r} {cause}" in str(err.value)


def test_the_cli_refuses_such_a_config_before_a_job_starts(capsys):
    for name, cause in [
        ("Wordle-v0", "needs NLTK data 'words'"),
        ("Tictactoe-v0", "nearest: TicTacToe-v0"),
    ]:
        code = main(["selfplay", str(CONFIG), "--set", f"env.name=textarena:{name}"])
        err = capsys.readouterr().err
        assert code == 2 and f"textarena:{name}" in err and cause in err
    with pytest.raises(ValidationError, match="unexpected keyword argument 'bogus'"):
        SelfPlayJobConfig(env={"name": "textarena:Nim-v0", "params": {"bogus": 1}})
    for penalty in (0.5, float("-inf"), float("nan")):  # a reward, not a penalty; not finite
        with pytest.raises(ValidationError, match="invalid_move_reward must be a finite number"):
            SelfPlayJobConfig(
                env={"name": "textarena:Nim-v0", "params": {"invalid_move_reward": penalty}}
            )


def test_the_selfplay_config_names_the_game_and_its_players():
    config = load_job(str(CONFIG), [], kind=SelfPlayJobConfig)
    assert config.agents == (P0, P1)
    assert config.games().make_game().view == "board"
    overrides = ["env.name=textarena:Nim-v0", "env.params={piles: [2, 3]}"]
    nim = load_job(str(CONFIG), overrides, kind=SelfPlayJobConfig).games().make_game()
    nim.reset(seed=0)
    assert nim.env.state.game_state["piles"] == [2, 3]  # a game's own keyword argument


def test_game_classes_pickle_by_name():
    cls = load("textarena:Nim-v0").target
    assert cls.__qualname__ == "Game_Nim-v0"
    assert pickle.loads(pickle.dumps(cls)) is cls
    config = load_job(str(CONFIG), [], kind=SelfPlayJobConfig)
    assert pickle.loads(pickle.dumps(config)).agents == (P0, P1)


def test_flowrl_imports_without_textarena():
    code = (
        "import sys; sys.modules['textarena'] = None\n"  # a failing import
        "import flowrl.environments.registry as r\n"
        "assert r.load('arithmetic').is_task_config\n"
        "try:\n"
        "    r.load('textarena:TicTacToe-v0')\n"
        "except r.EnvironmentLoadError as exc:\n"
        "    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "pip install 'flowrl[envs]'" in out.stdout and "textarena:TicTacToe-v0" in out.stdout
