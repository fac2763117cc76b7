"""Gomoku: the rules object, the heuristic opponent, the single-agent env, the task config."""

from __future__ import annotations

import pytest
from fakes import ByteChat, ScriptedSampler, say
from pydantic import ValidationError

from flowrl.agent_loop.loop import LoopLimits, run_episodes
from flowrl.agent_loop.types import StopReason
from flowrl.environments.gomoku import (
    EMPTY,
    PLAYER_O,
    PLAYER_X,
    GomokuBoard,
    GomokuTask,
    HeuristicPlayer,
    IllegalMove,
    format_move,
    parse_move,
)
from flowrl.environments.registry import make_task

TTT = GomokuTask.tic_tac_toe(opponent_random_fraction=0.0)


def board_from(rows: list[str], win_length: int) -> GomokuBoard:
    """A board from rows of ``.XO`` (stones placed in row-major order, X's then O's)."""
    board = GomokuBoard(len(rows), win_length)
    for player, mark in ((PLAYER_X, "X"), (PLAYER_O, "O")):
        for r, row in enumerate(rows):
            for c, cell in enumerate(row):
                if cell == mark:
                    board.play((r, c), player)
    return board


# --- rules ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "moves",
    [
        [(0, 0), (0, 1), (0, 2)],  # row
        [(0, 1), (1, 1), (2, 1)],  # column
        [(0, 0), (1, 1), (2, 2)],  # diagonal
        [(0, 2), (1, 1), (2, 0)],  # anti-diagonal
    ],
)
def test_three_in_a_row_wins_on_3x3(moves):
    board = GomokuBoard(3, 3)
    for k, move in enumerate(moves):
        assert board.winner() == EMPTY
        board.play(move, PLAYER_X)
        if k < 2:
            board.play(next(m for m in board.legal_moves() if m not in moves), PLAYER_O)
    assert board.winner() == PLAYER_X and board.is_over() and board.legal_moves() == []
    with pytest.raises(IllegalMove, match="over"):
        board.play((1, 0), PLAYER_O)


def test_five_in_a_row_on_9x9_and_four_is_not_enough():
    board = GomokuBoard(9, 5)
    for k in range(4):
        board.play((2 + k, 6 - k), PLAYER_O)  # anti-diagonal
        board.play((8, k), PLAYER_X)
    assert board.winner() == EMPTY and board.line_length((5, 3), PLAYER_O) == 4
    board.play((6, 2), PLAYER_O)
    assert board.winner() == PLAYER_O
    board = GomokuBoard(9, 5)
    for c in (0, 1, 2, 4):
        board.play((4, c), PLAYER_X)
    board.play((4, 3), PLAYER_X)  # filling the gap joins the runs
    assert board.winner() == PLAYER_X


def test_full_board_without_a_line_is_a_draw_and_render_is_compact():
    board = board_from(["XOX", "XOO", "OXX"], 3)
    assert board.is_full() and board.is_over() and board.winner() == EMPTY
    assert board.render() == " 123\n1XOX\n2XOO\n3OXX"
    assert len(GomokuBoard(9, 5).render()) == 10 * 10 + 9  # 10 lines of 10 chars


def test_illegal_moves_are_explained():
    board = GomokuBoard(3, 3)
    board.play((1, 1), PLAYER_X)
    with pytest.raises(IllegalMove, match="occupied"):
        board.play((1, 1), PLAYER_O)
    with pytest.raises(IllegalMove, match="off the board"):
        board.play((3, 0), PLAYER_O)
    with pytest.raises(IllegalMove, match="player"):
        board.play((0, 0), 3)
    assert len(board.legal_moves()) == 8
    copy = board.copy()
    copy.play((0, 0), PLAYER_O)
    assert len(board.moves) == 1 and len(copy.moves) == 2


def test_move_text_round_trips():
    assert parse_move("2,3") == (1, 2) and parse_move(" 10 , 1 ") == (9, 0)
    assert format_move((1, 2)) == "2,3"
    for bad in ("b2", "2 3", "2,3,4", "", "-1,2", "2,3 please"):
        assert parse_move(bad) is None


# --- heuristic opponent ---------------------------------------------------------------------


def test_heuristic_wins_when_it_can_before_blocking():
    board = board_from(["XX.", "OO.", "..."], 3)
    for seed in range(5):
        assert HeuristicPlayer(0.0, seed).choose(board, PLAYER_O) == (1, 2)  # win, not block (0, 2)
        assert HeuristicPlayer(0.0, seed).choose(board, PLAYER_X) == (0, 2)


def test_heuristic_blocks_an_open_line():
    board = board_from(["X..", ".X.", "O.."], 3)
    assert HeuristicPlayer(0.0, 1).choose(board, PLAYER_O) == (2, 2)
    big = GomokuBoard(9, 5)
    for c in range(4):
        big.play((0, c), PLAYER_X)
    big.play((5, 5), PLAYER_O)
    assert HeuristicPlayer(0.0, 0).choose(big, PLAYER_O) == (0, 4)


def test_heuristic_extends_its_own_lines_and_is_seeded():
    board = GomokuBoard(9, 5)
    board.play((4, 4), PLAYER_X)
    board.play((4, 5), PLAYER_X)
    move = HeuristicPlayer(0.0, 0).choose(board, PLAYER_X)
    assert move in {(4, 3), (4, 6)}
    picks = [HeuristicPlayer(1.0, "s").choose(GomokuBoard(9, 5), PLAYER_X) for _ in range(3)]
    assert len(set(picks)) == 1  # same seed, same "random" move
    assert len({HeuristicPlayer(1.0, s).choose(GomokuBoard(9, 5), PLAYER_X) for s in range(20)}) > 5


# --- the single-agent env -------------------------------------------------------------------


def test_policy_win_with_rewards_and_info():
    env = TTT.make_env()
    assert env.reset(seed=0, policy_first=True) == " 123\n1...\n2...\n3..."
    first = env.step("2,2")
    assert not first.done and first.reward == 0.0 and first.observation.count("O") == 1
    assert first.info == {
        "win": 0,
        "draw": 0,
        "loss": 0,
        "correct": False,
        "invalid_moves": 0,
        "invalid_rate": 0.0,
        "game_length": 2,
    }
    result = _play_heuristic_x(env)
    assert result.done and result.info["win"] + result.info["draw"] + result.info["loss"] == 1
    expected = {(1, 0, 0): 1.0, (0, 1, 0): 0.0, (0, 0, 1): -1.0}
    key = (result.info["win"], result.info["draw"], result.info["loss"])
    assert result.reward == expected[key]
    assert result.info["correct"] == (key != (0, 0, 1))


def test_opponent_first_and_opponent_win_is_a_loss():
    env = TTT.make_env()
    opening = env.reset(seed=3, policy_first=False)
    assert opening.count("O") == 1 and opening.count("X") == 0
    env = GomokuTask.tic_tac_toe(opponent_random_fraction=0.0).make_env()
    env.reset(seed=0, policy_first=False)  # O takes the centre; X then plays badly
    moves = iter(["1,2", "3,2", "2,1", "1,3", "3,3"])
    while not (result := env.step(next(m for m in moves if _free(env, m)))).done:
        pass
    assert result.info["loss"] == 1 and result.reward == -1.0 and result.info["correct"] is False


@pytest.mark.parametrize(
    ("action", "reason"),
    [("b2", "row,col"), ("4,1", "off the board"), ("0,1", "off the board"), ("", "row,col")],
)
def test_invalid_moves_are_penalised_and_explained(action, reason):
    env = TTT.make_env()
    env.reset(seed=0, policy_first=True)
    result = env.step(action)
    assert not result.done and result.reward == pytest.approx(-0.1)
    assert result.observation.startswith("invalid: ") and reason in result.observation
    assert result.observation.endswith(" 123\n1...\n2...\n3...")  # the board again
    assert result.info["invalid_moves"] == 1 and result.info["game_length"] == 0


def test_occupied_cell_and_too_many_invalid_moves_forfeit():
    task = GomokuTask.tic_tac_toe(max_invalid_moves=2, invalid_move_reward=-0.5)
    env = task.make_env()
    env.reset(seed=0, policy_first=True)
    env.step("2,2")
    occupied = env.step("2,2")
    assert "occupied" in occupied.observation and not occupied.done
    forfeit = env.step("9,9")
    assert forfeit.done and forfeit.info["loss"] == 1 and forfeit.info["invalid_moves"] == 2
    assert forfeit.info["invalid_rate"] == pytest.approx(2 / 3)  # 2 of its 3 moves
    assert forfeit.reward == pytest.approx(-1.0 - 0.5)
    with pytest.raises(RuntimeError, match="reset"):
        env.step("1,1")


def test_turn_cap_ends_the_game_as_a_draw():
    task = GomokuTask(size=9, win_length=5, max_policy_turns=2, opponent_random_fraction=0.0)
    env = task.make_env()
    env.reset(seed=0)
    assert not env.step("1,1").done
    result = env.step("9,9")
    assert result.done and result.info["draw"] == 1 and result.reward == 0.0
    assert result.info["game_length"] == 4


def test_games_are_deterministic_per_seed():
    task = GomokuTask.tic_tac_toe(opponent_random_fraction=0.5)
    transcripts = [[m["content"] for m in task.sft_example({"seed": 7})] for _ in range(2)]
    assert transcripts[0] == transcripts[1]
    others = {tuple(m["content"] for m in task.sft_example({"seed": s})) for s in range(10)}
    assert len(others) > 1


# --- task config ----------------------------------------------------------------------------


def test_eval_set_alternates_first_mover_and_train_stream_is_resumable():
    task = GomokuTask.tic_tac_toe(eval_size=6)
    eval_set = task.eval_set()
    assert [r["policy_first"] for r in eval_set] == [True, False] * 3
    assert len({r["seed"] for r in eval_set}) == 6 and eval_set == task.eval_set()
    source = task.train_source()
    first = source.next_batch(20)
    assert not {r["seed"] for r in eval_set} & {r["seed"] for r in first}
    assert {r["policy_first"] for r in first} == {True, False}
    resumed = task.train_source(start=10).next_batch(10)
    assert resumed == first[10:]


def test_sft_example_replays_to_the_same_game():
    task = GomokuTask.tic_tac_toe(opponent_random_fraction=0.3)
    for row in task.eval_set()[:10]:
        messages = task.sft_example(row)
        assert messages[0] == {"role": "system", "content": task.prompt}
        assert "row,col" in task.prompt
        env = task.make_env()
        assert env.reset(**row) == messages[1]["content"]
        for k, message in enumerate(messages[2:], 2):
            if message["role"] != "assistant":
                continue
            result = env.step(message["content"])
            if k + 1 < len(messages):
                assert result.observation == messages[k + 1]["content"]
        assert result.done and result.info["invalid_moves"] == 0


def test_scripted_game_through_the_agent_loop():
    task = GomokuTask.tic_tac_toe(opponent_random_fraction=0.0, system_prompt="")
    sampler = ScriptedSampler([[say("2,2")], [say("x")], [say("9,9")], [say("1,1")]])
    (traj,) = run_episodes(
        [task.make_env()],
        [{"seed": 0, "policy_first": True}],
        [0],
        sampler,
        ByteChat(),
        LoopLimits(max_turns=4, max_new_tokens=4, max_context_tokens=512),
    )
    assert [m["role"] for m in traj.messages[1::2]] == ["assistant"] * 4
    assert all(m["role"] == "user" for m in traj.messages[::2])
    assert traj.info["invalid_moves"] == 2 and traj.turn_rewards[1:3] == [-0.1, -0.1]
    assert traj.stop_reason is StopReason.MAX_TURNS and traj.info["game_length"] == 4


def test_cell_format_shows_free_cells_as_numbers():
    task = GomokuTask.tic_tac_toe(move_format="cell", opponent_random_fraction=0.0)
    assert "cell number" in task.prompt
    env = task.make_env()
    assert env.reset(seed=0, policy_first=True) == "123\n456\n789"
    assert parse_move("6", "cell", 3) == (1, 2) and format_move((1, 2), "cell", 3) == "6"
    assert parse_move("0", "cell", 3) is None and parse_move("2,3", "cell", 3) is None
    first = env.step("5")
    assert first.observation.count("X") == 1 and first.observation.count("O") == 1
    assert "5" not in first.observation and len(first.observation) == 11
    occupied = env.step("5")
    assert occupied.observation.startswith("invalid: occupied")
    bad = env.step("2,2")
    assert "free cell number" in bad.observation
    for row in task.eval_set()[:4]:  # demonstrations replay cleanly in this format too
        messages = task.sft_example(row)
        env = task.make_env()
        env.reset(**row)
        for m in messages:
            if m["role"] == "assistant":
                result = env.step(m["content"])
        assert result.done and result.info["invalid_moves"] == 0
    with pytest.raises(ValidationError, match="cell"):
        GomokuTask(size=9, win_length=5, move_format="cell")


def test_task_config_is_validated():
    with pytest.raises(ValidationError, match="win_length"):
        GomokuTask(size=3, win_length=5)
    with pytest.raises(ValidationError, match="extra"):
        GomokuTask(colour="X")
    assert make_task("gomoku", {"size": 3, "win_length": 3}).size == 3
    assert GomokuTask().size == 9 and GomokuTask().win_length == 5


def _free(env, text: str) -> bool:
    r, c = parse_move(text)
    return env.board.cells[r][c] == EMPTY


def _play_heuristic_x(env):
    player = HeuristicPlayer(0.0, "x")
    while True:
        result = env.step(format_move(player.choose(env.board, PLAYER_X)))
        if result.done:
            return result
