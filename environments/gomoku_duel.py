"""Two-player zero-sum Gomoku for the multi-agent coordinator (``agent_loop.coordinator``).

Agents ``"X"`` and ``"O"``. Each agent sees the board from its own side: its stones are shown
as X and the opponent's as O, so one system prompt ("You are X …") serves both, and a shared
policy (self-play) plays either side. Rules, rewards and caps come from ``GomokuTask``:
an invalid move costs the mover ``invalid_move_reward`` and it moves again; after
``max_invalid_moves`` it forfeits. Outcome: +win / −loss to the right player, draw otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from flowrl.environments.gomoku_board import (
    EMPTY,
    PLAYER_O,
    PLAYER_X,
    GomokuBoard,
    IllegalMove,
    parse_move,
)
from flowrl.environments.types import StepResult

if TYPE_CHECKING:  # the task imports this module (its games() side); only its type is needed
    from flowrl.environments.gomoku import GomokuTask

MARK = {"X": PLAYER_X, "O": PLAYER_O}
_SWAP = str.maketrans({"X": "O", "O": "X"})


class GomokuDuel:
    """One game between two agents; ``reset(first="X"|"O")`` picks who opens."""

    agents = ("X", "O")

    def __init__(self, task: GomokuTask) -> None:
        self.task = task
        self.board = GomokuBoard(task.size, task.win_length)
        self.turn: str | None = None
        self.invalid = {"X": 0, "O": 0}
        self.attempts = {"X": 0, "O": 0}
        self.notice = {"X": "", "O": ""}
        self.forfeit: str | None = None

    def reset(self, first: str = "X", **_: Any) -> None:
        if first not in self.agents:
            raise ValueError(f"first must be X or O, got {first!r}")
        self.board = GomokuBoard(self.task.size, self.task.win_length)
        self.turn, self.forfeit = first, None
        self.invalid = {"X": 0, "O": 0}
        self.attempts = {"X": 0, "O": 0}
        self.notice = {"X": "", "O": ""}

    def current_agent(self) -> str | None:
        return self.turn

    def observation(self, agent: str) -> str:
        board = self.task.render(self.board)
        view = board if agent == "X" else board.translate(_SWAP)
        return self.notice[agent] + view

    def get_system_prompt(self, agent: str) -> str:
        return self.task.prompt

    def act(self, agent: str, action: str) -> StepResult:
        if agent != self.turn:
            raise RuntimeError(f"it is {self.turn}'s turn, not {agent}'s")
        self.attempts[agent] += 1
        move = parse_move(action, self.task.move_format, self.task.size)
        try:
            if move is None:
                raise IllegalMove(f"write {self.task.format_hint}")
            self.board.play(move, MARK[agent])
        except IllegalMove as exc:
            return self._invalid(agent, str(exc))
        self.notice[agent] = ""
        if self.board.is_over():
            self.turn = None
            return StepResult("", 0.0, True, self._info(agent))
        self.turn = "O" if agent == "X" else "X"
        return StepResult("", 0.0, False, self._info(agent))

    def _invalid(self, agent: str, reason: str) -> StepResult:
        self.invalid[agent] += 1
        done = self.invalid[agent] >= self.task.max_invalid_moves
        if done:
            self.forfeit, self.turn = agent, None
        self.notice[agent] = f"invalid: {reason}\n"
        return StepResult("", self.task.invalid_move_reward, done, self._info(agent))

    def winner(self) -> str | None:
        if self.forfeit is not None:
            return "O" if self.forfeit == "X" else "X"
        mark = self.board.winner()
        return None if mark == EMPTY else ("X" if mark == PLAYER_X else "O")

    def final_rewards(self) -> dict[str, float]:
        winner = self.winner()
        if winner is None:
            return {a: self.task.draw_reward for a in self.agents}
        loser = "O" if winner == "X" else "X"
        return {winner: self.task.win_reward, loser: self.task.loss_reward}

    def _info(self, agent: str) -> dict[str, Any]:
        winner = self.winner() if self.turn is None else None
        return {
            "invalid_moves": self.invalid[agent],
            "invalid_rate": self.invalid[agent] / max(1, self.attempts[agent]),
            "game_length": len(self.board.moves),
            "win": int(winner == agent),
            "loss": int(winner is not None and winner != agent),
            "draw": int(self.turn is None and winner is None),
        }


class GomokuGames:
    """Gomoku's self-play side (``registry.make_games``): fresh duels, openings alternating who
    moves first, and evaluation against the heuristic opponent (the task itself: its policy
    sees the board from its own side, so one evaluation serves X, O and a shared policy)."""

    agents = GomokuDuel.agents

    def __init__(self, task: GomokuTask) -> None:
        self.task = task

    def make_game(self) -> GomokuDuel:
        return GomokuDuel(self.task)

    def openings(self, step: int, n: int) -> list[dict[str, Any]]:
        return [{"first": "X" if (step + i) % 2 == 0 else "O"} for i in range(n)]

    def head_to_head_rows(self) -> list[dict[str, Any]]:
        return [{"first": "X"}, {"first": "O"}]

    def versus(self, sides: tuple[str, ...]) -> GomokuTask:
        return self.task
