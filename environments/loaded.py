"""An environment name once resolved: what it points to (``Loaded``) and building one from it.

The lowest layer of environment loading, shared by the registry (``environments.registry``,
which resolves names) and the task configs it wraps classes in (``environments.plugin``,
``environments.games``), so that they need not import each other.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from flowrl.environments.types import Environment

CONTRACT = ("reset", "step", "get_system_prompt", "get_initial_user_message")
"""The methods every environment has (``environments.types.Environment``)."""


class EnvironmentLoadError(ValueError):
    """An environment name that cannot be loaded or used; the message names the cause."""


@dataclass(frozen=True)
class Loaded:
    """What an environment name resolved to."""

    name: str
    target: Any
    """The class or factory the name points to."""
    is_task_config: bool
    """True for a task config (pydantic model building envs and data), False for an env."""
    is_game: bool = False
    """True for a game between agents (``environments.games``): self-play's contract."""


def check_contract(name: str, obj: Any) -> None:
    """Raise ``EnvironmentLoadError`` when ``obj`` (a class or an environment built by a
    factory) lacks a method of the environment API (``CONTRACT``); ``name`` is the one it
    was loaded by."""
    missing = [m for m in CONTRACT if not callable(getattr(obj, m, None))]
    if missing:
        what = obj.__name__ if inspect.isclass(obj) else type(obj).__name__
        raise EnvironmentLoadError(
            f"environment {name!r}: {what} lacks method(s) {', '.join(missing)} of the "
            f"environment API ({', '.join(CONTRACT)})"
        )


def construct(loaded: Loaded, params: dict[str, Any]) -> Environment:
    """``loaded.target(**params)``, checked: an unknown parameter or a constructor error is
    an ``EnvironmentLoadError`` naming it, and a factory's result must have the environment
    API (a class was checked when it was loaded)."""
    try:
        env = loaded.target(**params)
    except Exception as exc:
        bad = _bad_params(loaded.target, params) if isinstance(exc, TypeError) else None
        if bad:
            raise EnvironmentLoadError(
                f"environment {loaded.name!r}: bad env.params: {bad}"
            ) from None
        raise EnvironmentLoadError(
            f"environment {loaded.name!r}: constructing it with env.params {params!r} raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if not inspect.isclass(loaded.target):
        check_contract(loaded.name, env)
    return env


def _bad_params(target: Any, params: dict[str, Any]) -> str | None:
    """Why ``params`` do not fit ``target``'s signature (None if they do, or it has none)."""
    try:
        inspect.signature(target).bind(**params)
    except TypeError as exc:
        return str(exc)
    except ValueError:
        return None
    return None
