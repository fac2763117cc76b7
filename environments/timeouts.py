"""A deadline on every ``reset`` and ``step`` of a user's environment (``env.step_timeout_s``).

A call that overruns fails its episode alone with ``EnvTimeoutError("step timed out after
60 s")``; the agent loop records it like any environment failure (``StopReason.ERROR``,
``info["error"]``) and the job goes on. A Python thread cannot be killed, so what a hung call
keeps depends on where it runs: in-process (``local`` mode, ``TimedEnv``) and in the HTTP
service the call's own daemon thread runs on until the call returns, its result dropped; in
``ray`` mode the actor that hosts it is killed (``environments.remote``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from flowrl.environments.types import Environment, StepResult

DEFAULT_STEP_TIMEOUT_S = 60.0
"""Seconds one ``reset`` or ``step`` may take unless the job says otherwise."""


class EnvTimeoutError(TimeoutError):
    """An environment's ``reset`` or ``step`` overran its deadline: the episode fails."""


def timeout_message(verb: str, timeout_s: float) -> str:
    """The reason an episode failed, e.g. ``"step timed out after 60 s"``."""
    return f"{verb} timed out after {timeout_s:g} s"


def call_with_timeout(fn: Callable[..., Any], timeout_s: float, verb: str, *args: Any) -> Any:
    """``fn(*args)`` run in a daemon thread of its own: its result (or its exception) when it
    returns within ``timeout_s`` seconds, else ``EnvTimeoutError``. An overrun call's thread
    cannot be stopped: it runs on until ``fn`` returns, and its result is dropped."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as exc:  # handed to the caller, whatever it is
            box["error"] = exc
        finally:
            done.set()

    threading.Thread(target=run, name=f"env-{verb}", daemon=True).start()
    if not done.wait(timeout_s):
        raise EnvTimeoutError(timeout_message(verb, timeout_s))
    if "error" in box:
        raise box["error"]
    return box["value"]


class TimedEnv:
    """An in-process environment whose ``reset`` and ``step`` each get ``timeout_s`` seconds
    (``local`` mode); every other attribute is the wrapped environment's own."""

    def __init__(self, env: Environment, timeout_s: float) -> None:
        self._env, self._timeout_s = env, timeout_s

    def reset(self, **row: Any) -> Any:
        return call_with_timeout(lambda: self._env.reset(**row), self._timeout_s, "reset")

    def step(self, action: str) -> StepResult:
        return call_with_timeout(self._env.step, self._timeout_s, "step", action)

    def get_system_prompt(self, *args: Any) -> str:  # a game's takes the agent
        return self._env.get_system_prompt(*args)

    def get_initial_user_message(self, *args: Any) -> str:
        return self._env.get_initial_user_message(*args)

    def __getattr__(self, name: str) -> Any:
        if name == "_env":  # not set yet (e.g. while unpickling): no recursion
            raise AttributeError(name)
        return getattr(self._env, name)
