"""Gomoku's rules and its reference player, with no environment API around them: the board
(``GomokuBoard``), the heuristic opponent (``HeuristicPlayer``) and how moves are written.

``environments.gomoku`` (the policy against the heuristic) and ``environments.gomoku_duel``
(two agents against each other) both play on these.
"""

from __future__ import annotations

import random
import re
from typing import Literal

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
