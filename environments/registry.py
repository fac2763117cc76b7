"""Environments by name: one loading path for flowrl's own environments and the user's.

``env.name`` takes these forms:

- ``reasoning_gym:<dataset>`` — a dataset of reasoning-gym (the ``envs`` extra), any name of
  its own registry, or ``reasoning_gym:composite`` for several with weights
  (``environments.reasoning_gym``); the library is imported only when such a name is used;
- ``textarena:<Game-v0>`` — a game of TextArena's registry (the ``envs`` extra), as a game
  between agents (``environments.textarena``); imported only when such a name is used;
- ``agent:<package.module>:<function>`` — the user's agent (an ``openai`` client or any
  framework on it) playing another environment's task through rollout sessions
  (``environments.agent``);
- ``package.module:Attribute`` — imported from the job's Python path;
- the name of an entry point in the group ``flowrl.environments`` of any installed package
  (flowrl's built-ins ``arithmetic``, ``tool_math``, ``gomoku`` and ``geometry`` are declared
  this way in flowrl's ``pyproject.toml``);
- nothing else: there is no hard-coded table.

What a name points to is either

- an **environment** — a class (or factory) following the environment API
  (``environments.types.Environment``: ``reset``, ``step``, ``get_system_prompt``,
  ``get_initial_user_message``, optional ``get_images`` and ``demonstration``). ``env.params``
  are its constructor's keyword arguments; its rows come from ``env.data`` files or are
  generated as ``{"seed": n}`` (``environments.plugin.PluginTask``); or
- a **task config** — a pydantic model with ``make_env``, ``train_source``, ``eval_set`` and
  ``sft_example`` (``environments.types.TaskConfig``), validated from ``env.params``: the form of
  the built-ins, which generate their own data; or
- a **game** between agents — a class with ``agents``, ``current_agent``, ``observation``,
  ``act``, ``final_rewards`` and ``opponent_move`` (``environments.games``): self-play plays its
  agents against each other, and every other job sees it from one side against the game's
  reference player (``VersusOpponent``).
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from functools import lru_cache, partial
from importlib.metadata import entry_points
from typing import Any

from pydantic import BaseModel

from flowrl.environments.games import (
    GAME_CONTRACT,
    GameTask,
    VersusOpponent,
    check_game,
    game_agents,
)
from flowrl.environments.loaded import EnvironmentLoadError, Loaded, check_contract, construct
from flowrl.environments.plugin import PluginTask, first_user_message
from flowrl.environments.timeouts import DEFAULT_STEP_TIMEOUT_S, TimedEnv
from flowrl.environments.types import Environment, TaskConfig

ENTRY_POINT_GROUP = "flowrl.environments"
"""Installed packages declare environments in this entry-point group."""
TASK_METHODS = ("make_env", "train_source", "eval_set", "sft_example")
REASONING_GYM_PREFIX = "reasoning_gym:"
"""``env.name`` prefix of reasoning-gym's datasets (``environments.reasoning_gym``)."""
TEXTARENA_PREFIX = "textarena:"
"""``env.name`` prefix of TextArena's games (``environments.textarena``)."""
AGENT_PREFIX = "agent:"
"""``env.name`` prefix of an agent playing a task through rollout sessions
(``environments.agent``)."""
_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def installed_names() -> list[str]:
    """Names of every environment declared by an installed package (``flowrl.environments``)."""
    return sorted({ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)})


@lru_cache(maxsize=256)
def load(name: str) -> Loaded:
    """Resolve ``name`` (``module:Attribute`` or an installed entry point's name).

    Raises ``EnvironmentLoadError`` naming the cause: the import error, the missing attribute, an
    unknown name (listing the installed ones), or an object that is neither a class nor a
    factory, or a class missing a method of the environment API.
    """
    if not isinstance(name, str) or not name.strip():
        raise EnvironmentLoadError(f"environment name must be a non-empty string, got {name!r}")
    prefix = next((p for p in LIBRARIES if name.startswith(p)), None)
    if prefix is not None:
        target = _library_target(name, prefix)
    elif ":" in name:
        target = import_attribute(name)
    else:
        matches = list(entry_points(group=ENTRY_POINT_GROUP, name=name))
        if not matches:
            known = ", ".join(installed_names()) or "none"
            raise EnvironmentLoadError(
                f"unknown environment {name!r}: not an installed environment (entry points "
                f"{ENTRY_POINT_GROUP!r}: {known}) and not of the form 'package.module:Class'"
            )
        try:
            target = matches[0].load()
        except Exception as exc:
            raise EnvironmentLoadError(
                f"environment {name!r}: its entry point {matches[0].value!r} does not load: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    if _looks_like_game(target):
        _check_game_contract(name, target)
        return Loaded(name, target, is_task_config=False, is_game=True)
    return Loaded(name, target, _check_target(name, target))


LIBRARIES = {
    REASONING_GYM_PREFIX: ("flowrl.environments.reasoning_gym", "task_class"),
    TEXTARENA_PREFIX: ("flowrl.environments.textarena", "game_class"),
    AGENT_PREFIX: ("flowrl.environments.agent", "agent_task_class"),
}
"""``env.name`` prefixes of shared libraries' environments: the adapter module and its function
from the name after the prefix to the class (the library is imported only then)."""


def _library_target(name: str, prefix: str) -> Any:
    """The class ``<prefix><id>`` names, from its library's adapter (``LIBRARIES``)."""
    module, builder = LIBRARIES[prefix]
    try:
        return getattr(importlib.import_module(module), builder)(name[len(prefix) :])
    except (ImportError, ValueError) as exc:  # not installed, or no such dataset or game
        raise EnvironmentLoadError(f"environment {name!r}: {exc}") from None


def import_attribute(name: str) -> Any:
    """The object ``package.module:Attribute`` names, imported from the job's Python path;
    ``EnvironmentLoadError`` naming why not."""
    module_name, _, attribute = name.partition(":")
    if not _DOTTED.fullmatch(module_name) or not _DOTTED.fullmatch(attribute):
        raise EnvironmentLoadError(
            f"environment {name!r}: expected 'package.module:Attribute' (dotted Python names)"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ModuleNotFoundError, or the module's own import-time error
        raise EnvironmentLoadError(
            f"environment {name!r}: cannot import module {module_name!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise EnvironmentLoadError(
                f"environment {name!r}: module {module_name!r} has no attribute {attribute!r}"
            ) from None
    return target


def _check_target(name: str, target: Any) -> bool:
    """True for a task config, False for an environment; raises for anything else."""
    if inspect.isclass(target) and issubclass(target, BaseModel):
        missing = [m for m in TASK_METHODS if not callable(getattr(target, m, None))]
        if missing:
            raise EnvironmentLoadError(
                f"environment {name!r}: {target.__name__} is a pydantic model but not a task "
                f"config (missing {', '.join(missing)})"
            )
        return True
    if not callable(target):
        raise EnvironmentLoadError(
            f"environment {name!r}: {type(target).__name__} object is not a class or factory"
        )
    if inspect.isclass(target):
        check_contract(name, target)
    return False


def _looks_like_game(target: Any) -> bool:
    """A class with turns between agents (``current_agent`` and ``act``) and no ``step``."""
    return (
        inspect.isclass(target)
        and not issubclass(target, BaseModel)
        and callable(getattr(target, "current_agent", None))
        and callable(getattr(target, "act", None))
        and not callable(getattr(target, "step", None))
    )


def _check_game_contract(name: str, target: Any) -> None:
    missing = [m for m in GAME_CONTRACT if not callable(getattr(target, m, None))]
    if missing:
        raise EnvironmentLoadError(
            f"environment {name!r}: {target.__name__} looks like a game (current_agent, act) but "
            f"lacks method(s) {', '.join(missing)} of the game API ({', '.join(GAME_CONTRACT)})"
        )
    try:
        game_agents(target, name)
    except ValueError as exc:
        raise EnvironmentLoadError(str(exc)) from None


def make_env(name: str, params: dict[str, Any] | None = None) -> Environment:
    """A fresh environment for one episode: what Ray env actors and the HTTP service build.
    ``params`` go to an environment's constructor, or validate a task config's fields."""
    return env_builder(name, params)()


def env_builder(name: str, params: dict[str, Any] | None = None) -> Callable[[], Environment]:
    """A function making one fresh environment per call, with the name resolved and a task
    config's ``params`` validated once, here (not per episode)."""
    loaded = load(name)
    if loaded.is_task_config:
        return loaded.target.model_validate(params or {}).make_env
    if loaded.is_game:
        build = partial(construct, loaded, dict(params or {}))
        return lambda: VersusOpponent(build())
    return partial(construct, loaded, dict(params or {}))


def make_task(
    name: str,
    params: dict[str, Any] | None = None,
    *,
    data: Any = None,
    eval_size: int = 200,
    seed: int = 0,
) -> TaskConfig:
    """The task config behind ``name``: the stages (rollout, eval, warm-up) use only it.

    A task config is validated from ``params`` (pydantic's ``ValidationError`` names a bad
    field); an environment is wrapped in a ``PluginTask`` with its rows from ``data``
    (``train``/``eval`` files) or generated seeds (``eval_size`` held out; the training stream's
    start derives from the job's ``seed``).
    """
    loaded = load(name)
    if loaded.is_task_config:
        if data is not None and (data.train or data.eval):
            raise EnvironmentLoadError(
                f"environment {name!r} generates its own data (a task config): env.data is for "
                "environments given as a class; use env.params"
            )
        return loaded.target.model_validate(params or {})
    if loaded.is_game:
        return GameTask(loaded, dict(params or {}), data, eval_size, seed)
    return PluginTask(loaded, dict(params or {}), data, eval_size, seed)


def make_games(
    name: str,
    params: dict[str, Any] | None = None,
    *,
    data: Any = None,
    eval_size: int = 200,
    seed: int = 0,
) -> Any:
    """The self-play side of ``name``: a ``GameTask`` for a game given as a class, or what a
    task config's ``games()`` returns (flowrl's Gomoku). Raises ``EnvironmentLoadError`` for
    an environment that is not a game between agents."""
    loaded = load(name)
    if loaded.is_game or callable(getattr(loaded.target, "games", None)):
        task = make_task(name, params, data=data, eval_size=eval_size, seed=seed)
        return task if loaded.is_game else task.games()
    raise EnvironmentLoadError(
        f"environment {name!r} is not a game between agents: self-play needs a class with "
        "agents, current_agent, observation, act, final_rewards and opponent_move "
        "(docs/environments.md: 'Your own game')"
    )


def check_environment(task: Any, timeout_s: float = DEFAULT_STEP_TIMEOUT_S) -> None:
    """Before a job starts: an environment given as a class constructs from its params and
    one ``reset`` on its first training row succeeds within ``timeout_s`` seconds. Raises
    ``ValueError`` naming the cause.
    (A task config was checked by validating its params.)"""
    if not isinstance(task, PluginTask):
        return
    if isinstance(task, GameTask):
        check_game(task)  # a game: its agents, first turn, observation and reference move
    name = task.loaded.name
    env = task.make_env()  # raises naming a bad parameter or the constructor's error
    try:
        row = task.train_source().next_batch(1)[0]
    except (OSError, ValueError) as exc:
        raise ValueError(f"environment {name!r}: cannot read its first row: {exc}") from exc
    try:
        first_user_message(env, TimedEnv(env, timeout_s).reset(**row))
    except Exception as exc:
        shown = repr(row) if len(repr(row)) <= 200 else repr(row)[:200] + "…"
        raise ValueError(
            f"environment {name!r}: reset(**row) raised {type(exc).__name__}: {exc} "
            f"(first training row {shown})"
        ) from exc
