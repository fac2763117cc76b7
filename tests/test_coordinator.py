"""The multi-agent coordinator with scripted policies on two-player 3x3 Gomoku: turn order,
reward attribution, isolation of agents' token streams, shared-policy self-play, failures."""

from __future__ import annotations

import dataclasses
import re

import pytest
from fakes import ByteChat, say

from flowrl.agent_loop.coordinator import run_multiagent_episodes
from flowrl.agent_loop.loop import LoopLimits
from flowrl.agent_loop.types import SampleResult, StopReason
from flowrl.environments.gomoku import PLAYER_O, PLAYER_X, GomokuTask
from flowrl.environments.gomoku_duel import GomokuDuel

TASK = GomokuTask.tic_tac_toe(move_format="cell", max_invalid_moves=2, invalid_move_reward=-0.1)
LIMITS = LoopLimits(max_turns=12, max_new_tokens=4, max_context_tokens=2048)
CHAT = ByteChat()


class CellPolicy:
    """Plays a free cell read off the last board it was shown: the lowest (``pick=min``) or
    highest (``pick=max``) number; ``garbage`` answers something that is not a move."""

    def __init__(self, name: str, pick=min, garbage: bool = False, ends: bool = True):
        """``ends=False``: the move is cut at the token budget before its stop token."""
        self.name, self.pick, self.garbage, self.ends = name, pick, garbage, ends
        self.calls: list[int] = []
        self.moves: list[str] = []

    def sample(self, prompts, max_new_tokens, temperature):
        self.calls.append(len(prompts))
        out = []
        for prompt in prompts:
            board = CHAT.decode(prompt).rsplit("<|user|>", 1)[1].split("<|end|>")[0]
            move = "?" if self.garbage else str(self.pick(int(c) for c in re.findall(r"\d", board)))
            self.moves.append(move)
            tokens = say(move, stop=self.ends)
            out.append(
                SampleResult(tokens, [-0.1] * len(tokens), "stop" if self.ends else "length")
            )
        return out


def play(x, o, rows, limits=LIMITS):
    envs = [GomokuDuel(TASK) for _ in rows]
    out = run_multiagent_episodes(envs, rows, {"X": x, "O": o}, CHAT, limits)
    return envs, out


def test_turn_order_alternates_and_the_opener_is_respected():
    x, o = CellPolicy("X", min), CellPolicy("O", max)
    envs, _ = play(x, o, [{"first": "X"}, {"first": "O"}])
    for env, opener in zip(envs, (PLAYER_X, PLAYER_O), strict=True):
        players = [player for _, player in env.board.moves]
        assert players[0] == opener
        assert all(a != b for a, b in zip(players, players[1:], strict=False))  # alternate


def test_rewards_go_to_the_right_player():
    # X opens and takes 1,2,3 (O answers 9,8): X wins the top row.
    envs, out = play(CellPolicy("X", min), CellPolicy("O", max), [{"first": "X"}])
    assert envs[0].winner() == "X"
    (tx,), (to,) = out["X"], out["O"]
    assert tx.turn_rewards == [0.0, 0.0, 1.0] and tx.reward == 1.0
    assert to.turn_rewards == [0.0, -1.0] and to.reward == -1.0
    assert tx.stop_reason is StopReason.DONE and to.stop_reason is StopReason.DONE
    # the outcome sits on each agent's last trainable token
    for t in (tx, to):
        last = max(i for i, m in enumerate(t.loss_mask) if m)
        assert t.token_rewards()[last] == t.reward


def test_only_the_agent_that_did_not_end_its_turns_is_charged_for_them():
    limits = dataclasses.replace(LIMITS, unfinished_turn_reward=-0.25)
    x, o = CellPolicy("X", min, ends=False), CellPolicy("O", max)
    envs, out = play(x, o, [{"first": "X"}], limits)
    assert envs[0].winner() == "X"  # X's cut moves are still its moves: it wins the top row
    (tx,), (to,) = out["X"], out["O"]
    assert tx.turn_rewards == [-0.25, -0.25, 0.75]
    assert to.turn_rewards == [0.0, -1.0]


def test_each_agent_trains_only_on_its_own_sampled_tokens():
    x, o = CellPolicy("X", min), CellPolicy("O", max)
    _, out = play(x, o, [{"first": "X"}, {"first": "O"}])
    for name, policy in (("X", x), ("O", o)):
        sampled = [
            CHAT.decode([tok for tok, m in zip(t.tokens, t.loss_mask, strict=True) if m])
            for t in out[name]
        ]
        moves = [mv for text in sampled for mv in text.split("<|end|>") if mv]
        assert sorted(moves) == sorted(policy.moves)  # exactly its own moves, nothing else
        for t in out[name]:
            assert len(t.tokens) == len(t.loss_mask) == len(t.logprobs)
            assert t.prompt_len > 0 and not any(t.loss_mask[: t.prompt_len])


def test_each_agent_sees_the_board_from_its_own_side():
    _, out = play(CellPolicy("X", min), CellPolicy("O", max), [{"first": "X"}])
    o_first_view = out["O"][0].messages[1]["content"]  # after X played 1
    assert o_first_view.startswith("O")  # the opponent's stone is O in O's own view


def test_invalid_moves_are_charged_to_the_mover_who_forfeits():
    envs, out = play(CellPolicy("X", min), CellPolicy("O", garbage=True), [{"first": "X"}])
    (tx,), (to,) = out["X"], out["O"]
    assert envs[0].winner() == "X"
    assert to.turn_rewards == [-0.1, pytest.approx(-1.1)]  # two invalid moves, then forfeit
    assert tx.turn_rewards == [1.0]
    assert to.info["invalid_moves"] == 2 and tx.info["invalid_moves"] == 0
    assert "invalid" in to.messages[3]["content"]  # it was told why


def test_one_shared_policy_plays_both_sides():
    shared = CellPolicy("both", min)
    _, out = play(shared, shared, [{"first": "X"}, {"first": "O"}])
    assert len(out["X"]) == len(out["O"]) == 2
    assert sum(shared.calls) == sum(len(t.turn_rewards) for a in out for t in out[a])


def test_a_raising_environment_fails_its_game_only():
    class Broken(GomokuDuel):
        def act(self, agent, action):
            raise RuntimeError("boom")

    envs = [Broken(TASK), GomokuDuel(TASK)]
    x, o = CellPolicy("X", min), CellPolicy("O", max)
    out = run_multiagent_episodes(envs, [{"first": "X"}] * 2, {"X": x, "O": o}, CHAT, LIMITS)
    assert out["X"][0].stop_reason is StopReason.ERROR
    assert out["X"][1].stop_reason is StopReason.DONE and envs[1].winner() == "X"
