"""Gomoku (k in a row on an n×n board), multi-turn, against a heuristic opponent.

Three layers, so that a multi-agent self-play coordinator can reuse the first two (they live
in ``environments.gomoku_board``; the duel of two agents in ``environments.gomoku_duel``):

- ``GomokuBoard``: pure rules. ``play(move, player)``, ``legal_moves()``, ``winner()``,
  ``is_over()``, ``render()``; moves are 0-based ``(row, col)``; players are ``PLAYER_X`` (1)
  and ``PLAYER_O`` (2).
- ``HeuristicPlayer``: win if it can, else block the opponent's win, else the move with the best
  window score (``move_score``: open lines it extends, opponent lines it blocks); with
  probability ``random_fraction`` a uniformly random legal move instead. Seeded per episode.
- ``GomokuEnv``: the single-agent wrapper. The policy is always X (``PLAYER_X``); the row says who
  moves first. Moves are written ``row,col`` (1-based, e.g. ``2,3``), as the system prompt says;
  on boards up to 3×3, ``move_format="cell"`` shows each free cell as its number
  (``"12X\nO56\n789"``) and a move is that number: choosing a legal move is then copying a
  digit, which a tiny char-level policy learns far more easily than reading a grid.

Rewards: ``win_reward`` / ``loss_reward`` / ``draw_reward`` at the end; ``invalid_move_reward``
for each invalid move (bad format, off the board, occupied), answered with an explanatory
observation and the board. ``max_invalid_moves`` invalid moves forfeit the game (a loss);
``max_policy_turns`` policy turns end it as a draw. Observations go to the policy as user
messages. Info fields: ``win``, ``draw``, ``loss`` (0/1), ``invalid_moves``, ``invalid_rate``
(invalid moves per move attempted), ``game_length``
(stones on the board) and ``correct`` (win or draw: what warm-up and eval accuracy count).
"""

from __future__ import annotations

import random
from typing import Any

from pydantic import BaseModel, Field, model_validator

from flowrl.environments.data import GeneratedSource
from flowrl.environments.gomoku_board import (
    EMPTY,
    PLAYER_O,
    PLAYER_X,
    GomokuBoard,
    HeuristicPlayer,
    IllegalMove,
    MoveFormat,
    format_move,
    parse_move,
)
from flowrl.environments.gomoku_duel import GomokuGames
from flowrl.environments.types import StepResult
from flowrl.infra.configfile import STRICT_MODEL_CONFIG


class GomokuEnv:
    """The policy (X) against a ``HeuristicPlayer`` (O); one policy move per turn."""

    observation_roles = ("user",)
    """The board after each move is a user turn (``types.OBSERVATION_ROLES``)."""

    def __init__(self, task: GomokuTask) -> None:
        self.task = task
        self.board = GomokuBoard(task.size, task.win_length)
        self.opponent = HeuristicPlayer(task.opponent_random_fraction)
        self._started = False
        self._done = False
        self._turns = self._invalid = 0

    def reset(self, seed: int | str, policy_first: bool = True, **_: Any) -> str:
        """Start game ``seed`` (seeds the opponent); O moves first unless ``policy_first``."""
        self.board = GomokuBoard(self.task.size, self.task.win_length)
        self.opponent = HeuristicPlayer(self.task.opponent_random_fraction, seed=seed)
        self._started, self._done = True, False
        self._turns = self._invalid = 0
        if not policy_first:
            self.board.play(self.opponent.choose(self.board, PLAYER_O), PLAYER_O)
        return self.task.render(self.board)

    def step(self, action: str) -> StepResult:
        if not self._started or self._done:
            raise RuntimeError("GomokuEnv.step called without an open game (call reset)")
        self._turns += 1
        move = parse_move(action, self.task.move_format, self.task.size)
        try:
            if move is None:
                raise IllegalMove(f"write {self.task.format_hint}")
            self.board.play(move, PLAYER_X)
        except IllegalMove as exc:
            return self._invalid_move(str(exc))
        if not self.board.is_over():
            self.board.play(self.opponent.choose(self.board, PLAYER_O), PLAYER_O)
        if self.board.is_over():
            return self._end(self.board.winner(), 0.0)
        if self._turns >= self.task.max_policy_turns:
            return self._end(EMPTY, 0.0)
        return StepResult(self.task.render(self.board), 0.0, False, self._info(EMPTY, over=False))

    def _invalid_move(self, reason: str) -> StepResult:
        self._invalid += 1
        penalty = self.task.invalid_move_reward
        if self._invalid >= self.task.max_invalid_moves:
            return self._end(PLAYER_O, penalty)  # forfeit
        if self._turns >= self.task.max_policy_turns:
            return self._end(EMPTY, penalty)
        text = f"invalid: {reason}\n{self.task.render(self.board)}"
        return StepResult(text, penalty, False, self._info(EMPTY, over=False))

    def _end(self, winner: int, extra: float) -> StepResult:
        self._done = True
        outcome = {PLAYER_X: self.task.win_reward, PLAYER_O: self.task.loss_reward}
        reward = outcome.get(winner, self.task.draw_reward) + extra
        return StepResult("", reward, True, self._info(winner, over=True))

    def _info(self, winner: int, over: bool) -> dict[str, Any]:
        win, loss = over and winner == PLAYER_X, over and winner == PLAYER_O
        draw = over and winner == EMPTY
        return {
            "win": int(win),
            "draw": int(draw),
            "loss": int(loss),
            "correct": win or draw,
            "invalid_moves": self._invalid,
            "invalid_rate": self._invalid / max(1, self._turns),
            "game_length": len(self.board.moves),
        }

    def get_system_prompt(self) -> str:
        return self.task.prompt

    def get_initial_user_message(self) -> str:
        if not self._started:
            raise RuntimeError("GomokuEnv has no game yet (call reset)")
        return self.task.render(self.board)


DEFAULT_SYSTEM_PROMPTS: dict[str, str] = {
    "row,col": "You are X. Reply row,col e.g. 2,3",
    "cell": "You are X. Reply a free cell number e.g. 5",
}
"""System prompt of each move format, used when ``GomokuTask.system_prompt`` is unset."""


class GomokuTask(BaseModel):
    """Games against the heuristic opponent; a row is ``{"seed": s, "policy_first": bool}``."""

    model_config = STRICT_MODEL_CONFIG

    size: int = Field(9, ge=3, le=19, description="Board side length.")
    win_length: int = Field(5, ge=3, description="Stones in a row that win.")
    opponent_random_fraction: float = Field(
        0.3, ge=0, le=1, description="Probability that the opponent plays a random legal move."
    )
    win_reward: float = Field(1.0, description="Reward when the policy wins.")
    loss_reward: float = Field(-1.0, description="Reward when the policy loses or forfeits.")
    draw_reward: float = Field(0.0, description="Reward of a draw (full board or turn cap).")
    invalid_move_reward: float = Field(
        -0.1, le=0, description="Reward added for each invalid move."
    )
    max_invalid_moves: int = Field(
        3, ge=1, description="Invalid moves that forfeit the game (a loss)."
    )
    max_policy_turns: int = Field(
        50, ge=1, description="Policy turns (valid or not) after which the game ends as a draw."
    )
    eval_size: int = Field(50, ge=1, le=10_000, description="Number of held-out evaluation games.")
    seed: int = Field(0, description="Seed of the eval games and of the training stream.")
    move_format: MoveFormat = Field(
        "row,col",
        description="'row,col' (1-based, e.g. 2,3) or 'cell' (boards up to 3x3: free cells are "
        "shown as their number 1-9 and a move is that number).",
    )
    system_prompt: str | None = Field(
        None,
        description="System prompt shown to the policy; unset = the move format's default, "
        "which states the format.",
    )

    @model_validator(mode="after")
    def _check(self) -> GomokuTask:
        if self.win_length > self.size:
            raise ValueError(f"win_length ({self.win_length}) > size ({self.size})")
        if self.move_format == "cell" and self.size > 3:
            raise ValueError(f"move_format 'cell' needs size <= 3, got size {self.size}")
        return self

    @property
    def prompt(self) -> str:
        """The system prompt in effect."""
        if self.system_prompt is None:
            return DEFAULT_SYSTEM_PROMPTS[self.move_format]
        return self.system_prompt

    @property
    def format_hint(self) -> str:
        return "row,col e.g. 2,3" if self.move_format == "row,col" else "a free cell number"

    def render(self, board: GomokuBoard) -> str:
        """The board as the policy sees it in this task's move format."""
        return board.render(cell_numbers=self.move_format == "cell")

    @classmethod
    def tic_tac_toe(cls, **overrides: Any) -> GomokuTask:
        """The CPU preset: 3×3, three in a row."""
        return cls(**{"size": 3, "win_length": 3, "max_policy_turns": 9, **overrides})

    def eval_set(self) -> list[dict[str, Any]]:
        """``eval_size`` seeded games; who moves first alternates (the policy first in game 0)."""
        return [
            {"seed": f"eval:{self.seed}:{i}", "policy_first": i % 2 == 0}
            for i in range(self.eval_size)
        ]

    def problem(self, i: int) -> dict[str, Any]:
        """Training game ``i``: its own opponent seed (never an eval seed); first mover random."""
        if i < 0:
            raise ValueError(f"game index must be >= 0, got {i}")
        rng = random.Random(f"flowrl.gomoku.train:{self.seed}:{i}")
        return {"seed": f"train:{self.seed}:{i}", "policy_first": rng.random() < 0.5}

    def train_source(self, start: int = 0) -> GeneratedSource:
        """The endless training stream ``problem(start), problem(start + 1), ...``."""
        return GeneratedSource(self.problem, start=start)

    def make_env(self) -> GomokuEnv:
        return GomokuEnv(self)

    def games(self) -> GomokuGames:
        """The self-play side: two agents, X and O (``gomoku_duel.GomokuGames``)."""
        return GomokuGames(self)

    def sft_example(self, row: dict[str, Any]) -> list[dict[str, str]]:
        """The game of ``row`` with the heuristic (never random) playing X as the assistant: it
        teaches the move format and sensible moves. Messages are exactly what the env shows."""
        env = self.make_env()
        player = HeuristicPlayer(0.0, seed=f"sft:{row['seed']}")
        messages = [{"role": "system", "content": self.prompt}] if self.prompt else []
        messages.append({"role": "user", "content": env.reset(**row)})
        while True:
            move = format_move(player.choose(env.board, PLAYER_X), self.move_format, self.size)
            messages.append({"role": "assistant", "content": move})
            result = env.step(move)
            if result.done:
                return messages
            messages.append({"role": "user", "content": result.observation})
