"""A user's game between agents: self-play's contract, and the one-sided view RL trains on.

A **game** is a class (constructor keyword arguments from ``env.params``) with

- ``agents``: a tuple of two or more distinct agent names (``[A-Za-z][A-Za-z0-9]{0,15}``);
- ``reset(**row)``: a new game for a data row (generated rows are ``{"seed": n}``);
- ``current_agent() -> str | None``: whose turn it is; ``None`` once the game is over;
- ``observation(agent) -> str``: what that agent is shown before it moves;
- ``get_system_prompt(agent) -> str``;
- ``act(agent, action) -> StepResult`` (or any object with ``observation``, ``reward``,
  ``done``, ``info``): play the agent's text; an invalid action is the game's to handle
  (reward, retry, forfeit) — it must never raise on policy text;
- ``final_rewards() -> dict[str, float]``: each agent's outcome once the game is over;
- ``opponent_move(agent) -> str``: the move a fixed reference player would make for
  ``agent`` now. Evaluation plays the policy against it, and warm-up imitates it.

``self-play`` plays the agents against each other (``agent_loop.coordinator``); ``rl-train`` and
every evaluation see the game as a one-player environment, ``VersusOpponent``: the policy plays
one side (the row's reserved ``play_as`` field, else the side chosen by the row's seed) and the
reference player answers for every other side.
"""

from __future__ import annotations

import copy
import re
from typing import Any

from flowrl.environments.loaded import Loaded, construct
from flowrl.environments.plugin import PluginTask, play, train_seed_start
from flowrl.environments.types import NoDemonstration, StepResult

GAME_CONTRACT = (
    "reset",
    "current_agent",
    "observation",
    "get_system_prompt",
    "act",
    "final_rewards",
    "opponent_move",
)
"""The methods of a game between agents (besides its ``agents`` tuple)."""
AGENT_NAME = re.compile(r"[A-Za-z][A-Za-z0-9]{0,15}")
PLAY_AS = "play_as"
"""Reserved row field: the side the policy plays in a ``VersusOpponent`` episode."""
MAX_REFERENCE_MOVES = 10_000
"""Reference moves in a row after which a game is declared stuck (its episode fails)."""


def winner(finals: dict[str, float]) -> str | None:
    """The agent with the single best final reward; ``None`` for a draw."""
    best = max(finals.values(), default=0.0)
    leaders = [a for a, r in finals.items() if r == best]
    return leaders[0] if len(leaders) == 1 else None


def game_agents(game: Any, name: str = "game") -> tuple[str, ...]:
    """``game.agents``, validated: two or more distinct names that fit storage and registry
    names. Raises ``ValueError`` naming what is wrong."""
    agents = getattr(game, "agents", None)
    if not isinstance(agents, tuple | list) or len(agents) < 2:
        raise ValueError(
            f"game {name!r}: `agents` must be a tuple of two or more agent names, got {agents!r}"
        )
    bad = [a for a in agents if not isinstance(a, str) or not AGENT_NAME.fullmatch(a)]
    if bad:
        raise ValueError(
            f"game {name!r}: agent names must match {AGENT_NAME.pattern}, got {bad[0]!r}"
        )
    if len(set(agents)) != len(agents):
        raise ValueError(f"game {name!r}: agent names must be distinct, got {list(agents)}")
    return tuple(agents)


class GameEnded(ValueError):
    """The game ended before the policy's first move (an episode that cannot be played)."""


class VersusOpponent:
    """A game seen from one side: the policy plays ``play_as``, the game's reference player
    (``opponent_move``) answers for the others. Reward per step is the policy's own move
    reward, plus its ``final_rewards()`` share when the game ends; ``info`` carries the
    move's fields and, at the end, ``outcome`` and ``win``."""

    def __init__(self, game: Any) -> None:
        self.game = game
        self.agents = game_agents(game, type(game).__name__)
        self.side = self.agents[0]

    def reset(self, **row: Any) -> str:
        side = row.pop(PLAY_AS, None)
        if side is None:
            seed = row.get("seed")
            side = self.agents[seed % len(self.agents)] if isinstance(seed, int) else None
        if side not in self.agents:
            raise ValueError(f"{PLAY_AS} must be one of {list(self.agents)}, got {side!r}")
        self.side = side
        self.game.reset(**row)
        self._reference_moves()
        if self.game.current_agent() is None:
            raise GameEnded("the game ended before the policy's first move")
        return self.game.observation(self.side)

    def get_system_prompt(self) -> str:
        return self.game.get_system_prompt(self.side)

    def get_initial_user_message(self) -> str:
        return self.game.observation(self.side)

    def step(self, action: str) -> StepResult:
        moved = self.game.act(self.side, action)
        reward, info = float(moved.reward), dict(moved.info or {})
        self._reference_moves()
        if self.game.current_agent() is not None:
            return StepResult(self.game.observation(self.side), reward, False, info)
        finals = self.game.final_rewards()
        outcome = float(finals.get(self.side, 0.0))
        info |= {"outcome": outcome, "win": int(winner(finals) == self.side)}
        return StepResult("", reward + outcome, True, info)

    def _reference_moves(self) -> None:
        for _ in range(MAX_REFERENCE_MOVES):
            agent = self.game.current_agent()
            if agent is None or agent == self.side:
                return
            self.game.act(agent, self.game.opponent_move(agent))
        raise RuntimeError(f"the reference player made {MAX_REFERENCE_MOVES} moves in a row")


class GameTask(PluginTask):
    """The task config of a game given as a class: rows as for any environment class
    (``PluginTask``: files or generated seeds), episodes as ``VersusOpponent`` views, and the
    self-play side: fresh games, openings per step, head-to-head rows."""

    def __init__(
        self,
        loaded: Loaded,
        params: dict[str, Any],
        data: Any,
        eval_size: int,
        seed: int,
        sides: tuple[str, ...] | None = None,
    ) -> None:
        super().__init__(loaded, params, data, eval_size, seed)
        self.agents = game_agents(loaded.target, loaded.name)
        self.sides = sides or self.agents

    @property
    def has_demonstrations(self) -> bool:
        return True  # the reference player's moves

    def make_game(self) -> Any:
        return construct(self.loaded, self.params)

    def make_env(self) -> VersusOpponent:
        return VersusOpponent(self.make_game())

    def eval_set(self) -> list[dict[str, Any]]:
        """The held-out rows, the policy's side taking turns over ``sides``."""
        rows = super().eval_set()
        return [{**row, PLAY_AS: self.sides[i % len(self.sides)]} for i, row in enumerate(rows)]

    def sft_example(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """One episode of the policy's side played by the reference player (warm-up): its
        moves are asked for one at a time, after each observation (``plugin.play``)."""
        env = self.make_env()
        moves = (env.game.opponent_move(env.side) for _ in range(MAX_REFERENCE_MOVES))
        try:
            messages = play(env, row, moves)
        except GameEnded as ended:  # e.g. a poker hand folded before the policy's side acts
            raise NoDemonstration(f"row {row}: {ended}") from ended
        if env.game.current_agent() is not None:
            raise RuntimeError(f"game {self.loaded.name!r}: the reference player never finished")
        return messages

    # ------------------------------------------------------------------ self-play side

    def openings(self, step: int, n: int) -> list[dict[str, Any]]:
        """The ``n`` game rows of self-play step ``step``: a pure function of the step, so a
        resumed job replays the same openings."""
        if self.train_uri:
            source = self.train_source()
            position = step * n
            source.load_state({"epoch": position // len(source), "index": position % len(source)})
            return source.next_batch(n)
        start = train_seed_start(self.seed) + step * n
        return [{"seed": start + i} for i in range(n)]

    def head_to_head_rows(self) -> list[dict[str, Any]]:
        """Held-out rows for the agents' greedy games against each other: one per agent."""
        rows = PluginTask.eval_set(self)
        return [copy.deepcopy(rows[i % len(rows)]) for i in range(len(self.agents))]

    def versus(self, sides: tuple[str, ...]) -> GameTask:
        """This game's evaluation with the policy on ``sides`` only."""
        view = copy.copy(self)
        view.sides = tuple(sides)
        return view


def check_game(task: GameTask) -> None:
    """Before a job starts: the game constructs from its params, one reset on its first row
    leaves an agent to move, and that agent has an observation and a reference move. Raises
    ``ValueError`` naming the cause."""
    name = task.loaded.name
    game = task.make_game()
    row = task.openings(0, 1)[0]
    try:
        game.reset(**row)
        agent = game.current_agent()
        if agent not in task.agents:
            raise ValueError(f"current_agent() returned {agent!r}, not one of {task.agents}")
        for method in ("observation", "opponent_move"):
            out = getattr(game, method)(agent)
            if not isinstance(out, str):
                raise ValueError(f"{method}({agent!r}) returned {type(out).__name__}, not str")
    except Exception as exc:
        raise ValueError(
            f"game {name!r}: on its first row {row!r}: {type(exc).__name__}: {exc}"
        ) from exc
