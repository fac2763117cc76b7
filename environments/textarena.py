"""TextArena's games as flowrl games, by name (``flowrl[envs]``).

``env.name: textarena:<Game-v0>`` plays a game of TextArena's own registry
(``textarena.envs.registration.ENV_REGISTRY``: ``TicTacToe-v0``, ``ConnectFour-v0``, ...) as a
game between agents (``environments.games``): self-play plays its players against each other,
and every other job (``rl-train``, evaluation, warm-up) sees it from one side against the
game's reference player. The library is imported only when such a name is used.

**Mapping.** Two players, agents ``Player0`` and ``Player1`` (TextArena's player ids 0 and 1;
the game picks who opens: player 0, except in KuhnPoker's first hand). The game is built from
its registered entry point and keyword arguments, without TextArena's observation wrappers,
and reset with ``seed`` = the row's seed (TextArena then seeds Python's global ``random``, as
it always does). Each player's messages from the game are routed as TextArena addresses
them: its ``PROMPT`` message becomes the player's system prompt, every later message (the
game's, and the other player's moves as the game echoes them) is gathered until the player
moves and shown as one user turn. The outcome is ``close()``'s rewards (+1/-1, 0 for a
draw), as ``final_rewards()``; a game that flowrl's own caps stop before TextArena ends it
scores 0 for every player.

**Invalid moves** are TextArena's to judge and handle: by its rules a player gets one retry
(the game tells it why) and loses the game on a second invalid move in a row. flowrl counts
them where every TextArena game signals them, its state's ``set_invalid_move`` (no message
text is parsed), and reports per move ``invalid_moves``, ``invalid_rate`` (invalid moves per
move attempted) and ``game_length`` (TextArena's turn counter); the outcome comes from
``final_rewards()`` (``outcome``, and ``win`` against the reference player), whichever player's
move ended the game. ``invalid_move_reward`` (default 0) is added to the mover's reward for each
one. (Accuracy: ``env.success: info.win`` counts wins; the default rule counts a positive
return.)

**Reference players** (``REFERENCE_PLAYERS``, per game class, so a game's variants such as
``TicTacToe-v0-raw`` or ``ConnectFour-v0-large`` share one; seeded per game row), read from
the game's state, never from message text:

- ``TicTacToe``: a uniformly random empty cell, ``[4]``;
- ``ConnectFour``: a uniformly random column that is not full, ``[3]``;
- ``Nim``: a uniformly random legal ``[pile quantity]``;
- ``Poker``: a random passive legal move: ``[Check]`` when nothing is due, else ``[Call]`` or
  ``[Fold]`` (it never bets or raises);
- ``KuhnPoker``: a uniformly random legal move of the hand's betting tree, ``[check]``,
  ``[bet]``, ``[call]`` or ``[fold]``;
- ``SimpleNegotiation``: no legal-move list, so a fixed policy: it never offers, accepts an
  offer it can pay that raises its own inventory value, and answers ``[Deny]`` otherwise.

A registered game outside this list is refused by name (there is no reference player to
evaluate against), as is a game that does not import (``Chess-v0`` on Python 3.11), one that
needs data that is not installed (``Wordle-v0``: NLTK's ``words``, which cannot be downloaded
offline) and one that does not play with two players.

**``env.params``**: ``view``, ``system_prompt``, ``invalid_move_reward`` and
``max_action_chars`` are flowrl's (documented on ``TextArenaGame``); every other key is a
keyword argument of the game's constructor, over its registered ones (e.g. ``piles`` for
``Nim-v0``, ``num_rows``/``num_cols`` for ``ConnectFour-v0``).

**Hostile text.** Model text is only ever handed to the game as its move (TextArena parses it
with its own regular expressions); a move longer than ``max_action_chars`` is handed over as
the empty move (invalid by every game's rules), which bounds what the game's parsing sees.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import io
import math
import random
import re
from collections.abc import Callable
from functools import cache
from typing import Any, ClassVar, Literal

from flowrl.environments.types import StepResult

PREFIX = "textarena:"
"""``env.name`` prefix: ``textarena:<Game-v0>``."""
INSTALL_HINT = "pip install 'flowrl[envs]'"
AGENTS = ("Player0", "Player1")
"""The agents of every TextArena game: its player ids 0 and 1 (the game picks who opens)."""
GAME_ID = -1
"""TextArena's sender id of the game's own messages (``textarena.GAME_ID``)."""
NO_NEWS = "Your move."
"""The user turn of a player whom the game told nothing new since its last move."""
View = Literal["all", "board"]


class TextArenaMissing(ImportError):
    """TextArena is not installed (the ``envs`` extra)."""


def _library() -> Any:
    """The ``textarena`` package, imported on first use only."""
    try:
        import textarena
    except ImportError as exc:
        raise TextArenaMissing(
            f"TextArena games need the textarena package: {INSTALL_HINT} "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    return textarena


def _registry() -> dict[str, Any]:
    _library()
    from textarena.envs.registration import ENV_REGISTRY

    return ENV_REGISTRY


def game_names() -> list[str]:
    """Every game id in TextArena's own registry."""
    return sorted(_registry())


def check_game_name(name: str) -> None:
    """Raise ``ValueError`` for a name not in TextArena's registry, listing the nearest."""
    names = game_names()
    if name in names:
        return
    near = difflib.get_close_matches(name, names, n=5, cutoff=0.0)
    raise ValueError(
        f"unknown TextArena game {name!r}; nearest: {', '.join(near)} "
        f"({len(names)} games: textarena.envs.registration.ENV_REGISTRY)"
    )


# ----------------------------------------------------------------------- reference players


def _tictactoe(env: Any, player: int, rng: random.Random) -> str:
    board = env.state.game_state["board"]
    free = [r * 3 + c for r in range(3) for c in range(3) if board[r][c] == ""]
    return f"[{rng.choice(free)}]"


def _connect_four(env: Any, player: int, rng: random.Random) -> str:
    top = env.state.game_state["board"][0]
    return f"[{rng.choice([c for c, cell in enumerate(top) if cell == '.'])}]"


def _nim(env: Any, player: int, rng: random.Random) -> str:
    piles = env.state.game_state["piles"]
    legal = [(i, q) for i, n in enumerate(piles) for q in range(1, n + 1)]
    pile, quantity = rng.choice(legal)
    return f"[{pile} {quantity}]"


def _poker(env: Any, player: int, rng: random.Random) -> str:
    state = env.state.game_state
    due = state["current_bet"] - state["player_bets"][player]
    return "[Check]" if due <= 0 else rng.choice(["[Call]", "[Fold]"])


def _kuhn_poker(env: Any, player: int, rng: random.Random) -> str:
    return f"[{rng.choice(sorted(env.state.game_state['current_legal_action_tree']))}]"


def _negotiation(env: Any, player: int, rng: random.Random) -> str:
    state = env.state.game_state
    offer = state["current_offer"]
    if not offer or offer["to_player"] != player:
        return "[Deny]"
    mine, values = state["player_resources"][player], state["player_values"][player]
    gets, pays = offer["offered_resources"], offer["requested_resources"]
    affordable = all(mine.get(r, 0) >= q for r, q in pays.items())
    gain = sum(values.get(r, 0) * q for r, q in gets.items())
    gain -= sum(values.get(r, 0) * q for r, q in pays.items())
    return "[Accept]" if affordable and gain > 0 else "[Deny]"


ReferencePlayer = Callable[[Any, int, random.Random], str]
REFERENCE_PLAYERS: dict[str, ReferencePlayer] = {
    "textarena.envs.TicTacToe.env:TicTacToeEnv": _tictactoe,
    "textarena.envs.ConnectFour.env:ConnectFourEnv": _connect_four,
    "textarena.envs.Nim.env:NimEnv": _nim,
    "textarena.envs.Poker.env:PokerEnv": _poker,
    "textarena.envs.KuhnPoker.env:KuhnPokerEnv": _kuhn_poker,
    "textarena.envs.SimpleNegotiation.env:SimpleNegotiationEnv": _negotiation,
}
"""The reference player of each supported game class (its entry point), reading the game's
state: ``(env, player_id, rng) -> move``, in the game's own action format."""


# ----------------------------------------------------------------------- loading a game


def _entry_point(spec: Any) -> str:
    entry = spec.entry_point
    return entry if isinstance(entry, str) else f"{entry.__module__}:{entry.__qualname__}"


def _import_class(game_id: str, entry: str) -> type:
    module_name, _, attribute = entry.partition(":")
    try:
        with _quiet():
            return getattr(importlib.import_module(module_name), attribute)
    except Exception as exc:  # SyntaxError included: Chess-v0's module on Python 3.11
        raise ValueError(
            f"TextArena game {game_id!r} does not import ({module_name}): "
            f"{type(exc).__name__}: {_first_line(exc)}"
        ) from None


@contextlib.contextmanager
def _quiet() -> Any:
    """Silence what a game prints while it loads (NLTK's failed download attempts)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        yield


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip().strip("*")]
    return lines[0] if lines else type(exc).__name__


def _guarded(game_id: str, call: Callable[[], Any]) -> Any:
    """``call()`` (building or resetting a game), quietly; raises ``ValueError`` naming the
    game and the cause (data not installed, not a two-player game, the game's own error)."""
    try:
        with _quiet():
            return call()
    except LookupError as exc:  # NLTK: "Resource 'words' not found"
        found = re.search(r"Resource '?([\w./-]+)'? not found", str(exc))
        what = f"NLTK data {found.group(1)!r}" if found else "data"
        raise ValueError(
            f"TextArena game {game_id!r} needs {what}, which is not installed and cannot be "
            "downloaded here (fetch it where a network is reachable: nltk.download(...), "
            "then point NLTK_DATA at it)"
        ) from None
    except AssertionError as exc:
        raise ValueError(
            f"TextArena game {game_id!r} does not play with {len(AGENTS)} players: "
            f"{_first_line(exc)}"
        ) from None
    except Exception as exc:
        raise ValueError(
            f"TextArena game {game_id!r}: {type(exc).__name__}: {_first_line(exc)}"
        ) from None


def game_class(game_id: str) -> type[TextArenaGame]:
    """The game class of ``textarena:<game_id>``, checked once per process: the name is in
    TextArena's registry (else the nearest are listed), its module imports, it starts with two
    players (data it needs is installed) and flowrl has its reference player. Raises
    ``ValueError`` naming the game and the cause, ``TextArenaMissing`` without the library.
    Reachable as this module's ``Game_<game_id>`` so that it pickles by name."""
    check_game_name(game_id)
    return _checked_class(game_id)


@cache
def _checked_class(game_id: str) -> type[TextArenaGame]:
    spec = _registry()[game_id]
    entry = _entry_point(spec)
    env_class = _import_class(game_id, entry)
    env = _guarded(game_id, lambda: env_class(**spec.kwargs))
    _guarded(game_id, lambda: env.reset(num_players=len(AGENTS), seed=0))
    if entry not in REFERENCE_PLAYERS:
        supported = sorted(e.split(".")[2] for e in REFERENCE_PLAYERS)
        raise ValueError(
            f"TextArena game {game_id!r} has no reference player in flowrl (needed to evaluate "
            f"and warm up); games with one: {', '.join(supported)} (their variants included)"
        )
    name = _CLASS_PREFIX + game_id
    return type(
        name,
        (TextArenaGame,),
        {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"TextArena's {game_id!r} as a game between agents.",
            "game_id": game_id,
        },
    )


_CLASS_PREFIX = "Game_"


def __getattr__(name: str) -> Any:
    """``Game_<game_id>``: the per-game classes, built on first use (unpickling included)."""
    if name.startswith(_CLASS_PREFIX):
        try:
            return game_class(name[len(_CLASS_PREFIX) :])
        except ValueError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------- the game


class TextArenaGame:
    """One TextArena game between ``Player0`` and ``Player1`` (``environments.games``'s
    contract); built per game id by ``game_class``. Constructor keywords beyond flowrl's are
    the game's own."""

    agents: ClassVar[tuple[str, ...]] = AGENTS
    game_id: ClassVar[str] = ""
    """The TextArena game id (set on each per-game subclass)."""

    def __init__(
        self,
        view: View = "all",
        system_prompt: str | None = None,
        invalid_move_reward: float = 0.0,
        max_action_chars: int = 1000,
        **game_kwargs: Any,
    ) -> None:
        """``view``: what a user turn shows: ``all`` the game's messages since the player's
        last move, or ``board`` only the latest board (``GAME_BOARD`` message) and any
        invalid-move notice (short prompts, for tiny models). ``system_prompt``: replaces the
        game's own prompt (which may carry private information, e.g. a negotiator's values).
        ``invalid_move_reward`` (<= 0): added to the mover's reward per invalid move.
        ``max_action_chars``: a longer move is handed to the game as the empty move."""
        if not self.game_id:
            raise TypeError("use textarena.game_class(game_id): TextArenaGame is abstract")
        if view not in ("all", "board"):
            raise ValueError(f"view must be 'all' or 'board', got {view!r}")
        if not math.isfinite(invalid_move_reward) or invalid_move_reward > 0:
            raise ValueError(
                f"invalid_move_reward must be a finite number <= 0, got {invalid_move_reward}"
            )
        if max_action_chars < 1:
            raise ValueError(f"max_action_chars must be >= 1, got {max_action_chars}")
        spec = _registry()[self.game_id]
        self.entry = _entry_point(spec)
        env_class = _import_class(self.game_id, self.entry)
        kwargs = {**spec.kwargs, **game_kwargs}
        self.env = _guarded(self.game_id, lambda: env_class(**kwargs))
        self.reference = REFERENCE_PLAYERS[self.entry]
        self.view, self.system_prompt = view, system_prompt
        self.invalid_move_reward, self.max_action_chars = invalid_move_reward, max_action_chars
        self.started = False
        self.rng = random.Random(0)
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.prompts = dict.fromkeys(AGENTS, "")
        self.pending: dict[str, list[tuple[int, str, Any]]] = {a: [] for a in AGENTS}
        self.invalid = dict.fromkeys(AGENTS, 0)
        self.attempts = dict.fromkeys(AGENTS, 0)
        self._signalled = 0

    def reset(self, seed: int = 0, **_: Any) -> None:
        """A new game, seeded ``seed`` (TextArena's reset seed; the reference player's too)."""
        if type(seed) is not int:
            raise ValueError(f"a TextArena game row's seed must be an int, got {seed!r}")
        _guarded(self.game_id, lambda: self.env.reset(num_players=len(AGENTS), seed=seed))
        self.started = True
        self.rng = random.Random(f"flowrl.textarena:{self.game_id}:{seed}")
        self._reset_counters()
        self._count_invalid_moves(self.env.state)
        self._collect()
        for agent in AGENTS:
            prompts = [m for _, m, kind in self.pending[agent] if kind.name == "PROMPT"]
            self.prompts[agent] = "\n".join(prompts)
            self.pending[agent] = [p for p in self.pending[agent] if p[2].name != "PROMPT"]

    def _count_invalid_moves(self, state: Any) -> None:
        """Count the game's own invalid-move signal: every TextArena game reports an invalid
        move through its state's ``set_invalid_move`` (a retry or a forfeit)."""
        signal = state.set_invalid_move

        def counted(*args: Any, **kwargs: Any) -> Any:
            self._signalled += 1
            return signal(*args, **kwargs)

        state.set_invalid_move = counted

    def _collect(self) -> None:
        """Move every player's undelivered messages from the game into its pending turn."""
        queues = self.env.state.observations
        for pid, agent in enumerate(AGENTS):
            self.pending[agent].extend(queues.get(pid, []))
            queues[pid] = []

    def current_agent(self) -> str | None:
        if not self.started or self.env.state.done:
            return None
        return AGENTS[self.env.state.current_player_id]

    def get_system_prompt(self, agent: str) -> str:
        return self.system_prompt if self.system_prompt is not None else self.prompts[agent]

    def observation(self, agent: str) -> str:
        """The player's user turn: the game's messages to it since its last move."""
        messages = self.pending[agent]
        if self.view == "board":
            boards = [m for m in messages if m[2].name == "GAME_BOARD"]
            notices = [m for m in messages if m[2].name == "GAME_ADMIN"]
            messages = notices + boards[-1:] if boards else messages
        text = "\n".join(_render(sender, message) for sender, message, _ in messages)
        return text or NO_NEWS

    def act(self, agent: str, action: str) -> StepResult:
        if self.current_agent() != agent:
            raise RuntimeError(f"it is {self.current_agent()}'s turn, not {agent}'s")
        move = str(action)
        if len(move) > self.max_action_chars:
            move = ""  # invalid by the game's own rules, without parsing the text
        self.pending[agent] = []
        self.attempts[agent] += 1
        before = self._signalled
        self.env.step(move)
        invalid = self._signalled > before
        self.invalid[agent] += int(invalid)
        self._collect()
        done = bool(self.env.state.done)
        reward = self.invalid_move_reward if invalid else 0.0
        return StepResult("", reward, done, self._info(agent))

    def final_rewards(self) -> dict[str, float]:
        """``close()``'s rewards once TextArena ended the game; 0 for all if it did not."""
        if not self.started or not self.env.state.done:
            return dict.fromkeys(AGENTS, 0.0)
        closed = self.env.close()
        rewards = closed[0] if isinstance(closed, tuple) else closed
        return {agent: float((rewards or {}).get(pid, 0.0)) for pid, agent in enumerate(AGENTS)}

    def opponent_move(self, agent: str) -> str:
        """The reference player's move for ``agent`` now (``REFERENCE_PLAYERS``)."""
        return self.reference(self.env, AGENTS.index(agent), self.rng)

    def _info(self, agent: str) -> dict[str, Any]:
        return {
            "invalid_moves": self.invalid[agent],
            "invalid_rate": self.invalid[agent] / max(1, self.attempts[agent]),
            "game_length": int(self.env.state.turn),
        }


def _render(sender: int, message: str) -> str:
    return message if sender == GAME_ID else f"[Player {sender}] {message}"
