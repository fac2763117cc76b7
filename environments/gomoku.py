"""Gomoku (k in a row on an n×n board), multi-turn, against a heuristic opponent.

Three layers, so that a multi-agent self-play coordinator can reuse the first two:

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
import re
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from flowrl.environments.data import GeneratedSource
from flowrl.environments.types import StepResult
from flowrl.infra.configfile import STRICT_MODEL_CONFIG

EMPTY, PLAYER_X, PLAYER_O = 0, 1, 2
MARKS = {EMPTY: ".", PLAYER_X: "X", PLAYER_O: "O"}
DIRECTIONS = ((0, 1), (1, 0), (1, 1), (1, -1))
Move = tuple[int, int]
_MOVE = re.compile(r"\s*(\d{1,2})\s*,\s*(\d{1,2})\s*", re.ASCII)  # ASCII digits only
_CELL = re.compile(r"\s*([1-9])\s*")
MoveFormat = Literal["row,col", "cell"]


class IllegalMove(ValueError):
    """A move off the board, on an occupied cell, by the wrong player, or after the end."""


class GomokuBoard:
    """An ``size × size`` board; ``win_length`` stones in a row (any direction) win."""

    def __init__(self, size: int = 9, win_length: int = 5) -> None:
        if not 1 <= win_length <= size:
            raise ValueError(f"need 1 <= win_length <= size, got {win_length} and {size}")
        self.size, self.win_length = size, win_length
        self.cells = [[EMPTY] * size for _ in range(size)]
        self.moves: list[tuple[Move, int]] = []
        self._winner = EMPTY

    def copy(self) -> GomokuBoard:
        other = GomokuBoard(self.size, self.win_length)
        other.cells = [list(row) for row in self.cells]
        other.moves, other._winner = list(self.moves), self._winner
        return other

    def on_board(self, move: Move) -> bool:
        return 0 <= move[0] < self.size and 0 <= move[1] < self.size

    def legal_moves(self) -> list[Move]:
        """Empty cells in row-major order; none once the game is over."""
        if self.is_over():
            return []
        n = self.size
        return [(r, c) for r in range(n) for c in range(n) if self.cells[r][c] == EMPTY]

    def play(self, move: Move, player: int) -> None:
        """Place ``player``'s stone at ``move`` (0-based); raises ``IllegalMove`` explaining why."""
        if player not in (PLAYER_X, PLAYER_O):
            raise IllegalMove(f"player must be {PLAYER_X} or {PLAYER_O}, got {player}")
        if self.is_over():
            raise IllegalMove("the game is over")
        if not self.on_board(move):
            raise IllegalMove(f"off the board (1-{self.size})")
        if self.cells[move[0]][move[1]] != EMPTY:
            raise IllegalMove("occupied")
        self.cells[move[0]][move[1]] = player
        self.moves.append((move, player))
        if self.line_length(move, player) >= self.win_length:
            self._winner = player

    def line_length(self, move: Move, player: int) -> int:
        """Longest run of ``player``'s stones through ``move``, counting ``move`` itself (which
        may be empty: then it is the run the move would make)."""
        return max(1 + sum(self.runs(move, d, player)) for d in DIRECTIONS)

    def runs(self, move: Move, direction: Move, player: int) -> tuple[int, int]:
        """Stones of ``player`` next to ``move`` going forward and backward along ``direction``."""
        counts = []
        for sign in (1, -1):
            r, c, k = move[0], move[1], 0
            while True:
                r, c = r + sign * direction[0], c + sign * direction[1]
                if not self.on_board((r, c)) or self.cells[r][c] != player:
                    break
                k += 1
            counts.append(k)
        return counts[0], counts[1]

    def winner(self) -> int:
        """The player with ``win_length`` in a row, else ``EMPTY`` (0)."""
        return self._winner

    def is_full(self) -> bool:
        return len(self.moves) == self.size * self.size

    def is_over(self) -> bool:
        return self._winner != EMPTY or self.is_full()

    def render(self, cell_numbers: bool = False) -> str:
        """Compact text: a header of column numbers, then one line per row (``.XO``).

        Columns above 9 are written modulo 10 to keep one character per cell. With
        ``cell_numbers`` (boards up to 3×3) there are no labels and each free cell shows its
        number ``1..9`` (row-major): ``"12X\nO56\n789"``."""
        if cell_numbers:
            if self.size > 3:
                raise ValueError("cell numbers need a board of at most 3x3")
            marks = [
                [MARKS[v] if v else str(r * self.size + c + 1) for c, v in enumerate(row)]
                for r, row in enumerate(self.cells)
            ]
            return "\n".join("".join(row) for row in marks)
        header = " " + "".join(str((c + 1) % 10) for c in range(self.size))
        rows = [
            str((r + 1) % 10) + "".join(MARKS[v] for v in self.cells[r]) for r in range(self.size)
        ]
        return "\n".join([header, *rows])


def winning_moves(board: GomokuBoard, player: int) -> list[Move]:
    """Legal moves that would win at once for ``player``."""
    return [m for m in board.legal_moves() if board.line_length(m, player) >= board.win_length]


class HeuristicPlayer:
    """Win if possible, else block, else the best-scoring move; random with ``random_fraction``."""

    def __init__(self, random_fraction: float = 0.0, seed: int | str = 0) -> None:
        if not 0.0 <= random_fraction <= 1.0:
            raise ValueError(f"random_fraction must be in [0, 1], got {random_fraction}")
        self.random_fraction = random_fraction
        self.rng = random.Random(f"flowrl.gomoku.heuristic:{seed}")

    def choose(self, board: GomokuBoard, player: int) -> Move:
        legal = board.legal_moves()
        if not legal:
            raise IllegalMove("no legal move: the game is over")
        if self.rng.random() < self.random_fraction:
            return self.rng.choice(legal)
        opponent = PLAYER_O if player == PLAYER_X else PLAYER_X
        for candidates in (winning_moves(board, player), winning_moves(board, opponent)):
            if candidates:
                return self.rng.choice(candidates)
        scores = {m: move_score(board, m, player) for m in legal}
        best = max(scores.values())
        return self.rng.choice([m for m in legal if scores[m] == best])


def move_score(board: GomokuBoard, move: Move, player: int) -> float:
    """Sum over the ``win_length`` windows through ``move`` (all four directions): a window still
    free of opponent stones scores ``(1 + own stones)**2`` (attack), one free of own stones
    ``0.5 * opponent stones**2`` (defence); a small pull towards the centre breaks ties.
    On an empty 3×3 board: centre 4 > corner 3 > edge 2."""
    opponent = PLAYER_O if player == PLAYER_X else PLAYER_X
    k, score = board.win_length, 0.0
    for dr, dc in DIRECTIONS:
        for start in range(-(k - 1), 1):
            window = [(move[0] + (start + i) * dr, move[1] + (start + i) * dc) for i in range(k)]
            if not all(board.on_board(cell) for cell in window):
                continue
            stones = [board.cells[r][c] for r, c in window]
            own, opp = stones.count(player), stones.count(opponent)
            if opp == 0:
                score += (1 + own) ** 2
            if own == 0:
                score += 0.5 * opp**2
    centre = (board.size - 1) / 2
    return score - 0.01 * (abs(move[0] - centre) + abs(move[1] - centre))


def parse_move(text: str, move_format: MoveFormat = "row,col", size: int = 3) -> Move | None:
    """``"2,3"`` → ``(1, 2)`` (0-based); in ``"cell"`` format ``"6"`` → ``(1, 2)`` on a 3×3
    board. ``None`` if the text is not a move in that format (it may still be off the board)."""
    if move_format == "cell":
        match = _CELL.fullmatch(text)
        return None if match is None else divmod(int(match.group(1)) - 1, size)
    match = _MOVE.fullmatch(text)
    if match is None:
        return None
    return int(match.group(1)) - 1, int(match.group(2)) - 1


def format_move(move: Move, move_format: MoveFormat = "row,col", size: int = 3) -> str:
    """``(1, 2)`` → ``"2,3"`` (or ``"6"`` in ``"cell"`` format on 3×3): how the policy writes it."""
    if move_format == "cell":
        return str(move[0] * size + move[1] + 1)
    return f"{move[0] + 1},{move[1] + 1}"


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

    def games(self) -> Any:
        """The self-play side: two agents, X and O (``gomoku_duel.GomokuGames``)."""
        from flowrl.environments.gomoku_duel import GomokuGames

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
