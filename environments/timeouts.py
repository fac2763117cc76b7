"""A deadline on every ``reset`` and ``step`` of a user's environment (``env.step_timeout_s``).

A call that overruns fails its episode alone with ``EnvTimeoutError("step timed out after
60 s")``; the agent loop records it like any environment failure (``StopReason.ERROR``,
``info["error"]``) and the job goes on. A Python thread cannot be killed, so what a hung call
keeps depends on where it runs: in-process (``local`` mode, ``TimedEnv``: the process that plays
the episodes, a colocated policy's worker or the rollout's) and in the HTTP service the call's
own daemon thread runs on until the call returns, its result dropped; in
``ray`` mode the actor that hosts it is killed (``environments.remote``).

The agent loop makes a round's calls (every episode's ``reset``, then every episode's ``step``
of a turn) with ``call_all``: one thread runs them in order, and a call still running after
``SLOW_CALL_S`` lets the next ones start on another thread. So k hung calls in a round cost about
one timeout, not k, and calls that return at once keep their order and cost no thread each. An
environment whose episodes share nothing gives the same results either way; one whose episodes
share state (a class-level random generator, a cache) must guard it with a lock, and its slow
calls no longer run in episode order.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from flowrl.environments.types import Environment, StepResult

DEFAULT_STEP_TIMEOUT_S = 60.0
"""Seconds one ``reset`` or ``step`` may take unless the job says otherwise."""


class EnvTimeoutError(TimeoutError):
    """An environment's ``reset`` or ``step`` overran its deadline: the episode fails."""


class CallsAbandoned(RuntimeError):
    """The job is stopping (``abandoning_calls``): a call it was waiting for was left running."""


_ABANDON = threading.Event()


@contextlib.contextmanager
def abandoning_calls() -> Iterator[None]:
    """While inside, every ``call_all`` of this process returns within ``SLOW_CALL_S``, its
    unfinished calls ``Failed`` with ``CallsAbandoned``: a stopping job's stage threads end
    instead of waiting out their environments' deadlines (the hung calls' daemon threads are
    left to the process's exit)."""
    _ABANDON.set()
    try:
        yield
    finally:
        _ABANDON.clear()


def abandon_calls() -> None:
    """Abandon calls from now on, until the ``abandoning_calls`` block that the caller enters
    later leaves (a job's stop that begins before its stage runner's)."""
    _ABANDON.set()


def calls_abandoned() -> bool:
    """Whether the job is stopping (inside ``abandoning_calls``): waits should end now."""
    return _ABANDON.is_set()


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


SLOW_CALL_S = 0.05
"""A call running this long lets the round's next calls start on another thread."""


@dataclass(frozen=True)
class EnvCall:
    """One call of a round: ``fn()``, with ``timeout_s`` seconds from its start (None: no
    deadline); ``verb`` names it in a timeout's message."""

    fn: Callable[[], Any]
    timeout_s: float | None
    verb: str


@dataclass(frozen=True)
class Failed:
    """What ``call_all`` gives for a call that raised (or overran: ``EnvTimeoutError``)."""

    error: BaseException


def env_call(
    env: Any, verb: str, then: Callable[[Any, Any], Any] | None = None, *args: Any, **kw: Any
) -> EnvCall:
    """``env.<verb>(*args, **kw)`` as an ``EnvCall``, with the deadline of a ``TimedEnv`` (called on
    the environment it wraps: no thread of its own). ``then(env, result)``, if given, runs
    after it within the same deadline (e.g. reading the prompt a reset set up)."""
    inner, timeout_s = (env._env, env._timeout_s) if isinstance(env, TimedEnv) else (env, None)
    method = getattr(inner, verb)

    def fn() -> Any:
        result = method(*args, **kw)
        return result if then is None else then(inner, result)

    return EnvCall(fn, timeout_s, verb)


def call_all(calls: Sequence[EnvCall]) -> list[Any]:
    """Run ``calls`` and give their results in order, a ``Failed`` for each that raised or ran
    past its deadline (module docstring: how they share threads). Returns when every call has
    returned or overrun; an overrun call's thread runs on, its result dropped."""
    if not calls:
        return []
    return _Round(calls).run()


class _Round:
    """The state of one ``call_all``. No lock per call: the next call's index and the count of
    settled calls come from ``itertools.count`` and a result is settled by ``dict.setdefault``,
    each one step under the GIL, so a late result never replaces a timeout's."""

    def __init__(self, calls: Sequence[EnvCall]) -> None:
        self.calls = calls
        self.next = itertools.count()
        self.settled = itertools.count(1)
        self.all_settled = threading.Event()
        self.started: dict[int, float] = {}
        self.results: dict[int, Any] = {}
        self.current: list[int] = []  # the call each thread is on, by thread

    def run(self) -> list[Any]:
        n = len(self.calls)
        self._add_thread()
        while not self.all_settled.wait(self._wait_s()):
            if _ABANDON.is_set():
                for i in range(n):
                    self._settle(i, Failed(CallsAbandoned("the job is stopping")))
                break
            now = time.monotonic()
            for i, start in list(self.started.items()):
                timeout_s = self.calls[i].timeout_s
                if i not in self.results and timeout_s is not None and now >= start + timeout_s:
                    message = timeout_message(self.calls[i].verb, timeout_s)
                    self._settle(i, Failed(EnvTimeoutError(message)))
            # Every thread on a call that has run SLOW_CALL_S: the next calls get one more.
            if len(self.started) < n and all(
                now - self.started.get(i, now) >= SLOW_CALL_S for i in self.current
            ):
                self._add_thread()
        return [self.results[i] for i in range(n)]

    def _wait_s(self) -> float:
        """Until the next check: the nearest deadline, or SLOW_CALL_S."""
        now, wait = time.monotonic(), SLOW_CALL_S
        for i, start in list(self.started.items()):
            timeout_s = self.calls[i].timeout_s
            if timeout_s is not None and i not in self.results:
                wait = min(wait, start + timeout_s - now)
        return max(wait, 0.0)

    def _add_thread(self) -> None:
        slot = len(self.current)
        self.current.append(-1)
        threading.Thread(target=self._work, args=(slot,), name="env-calls", daemon=True).start()

    def _work(self, slot: int) -> None:
        while (i := next(self.next)) < len(self.calls):
            self.current[slot] = i
            self.started[i] = time.monotonic()
            try:
                result: Any = self.calls[i].fn()
            except BaseException as exc:  # handed to the caller, whatever it is
                result = Failed(exc)
            self._settle(i, result)  # an overrun call's result is dropped here
        self.current[slot] = -1

    def _settle(self, i: int, result: Any) -> None:
        if self.results.setdefault(i, result) is result and next(self.settled) == len(self.calls):
            self.all_settled.set()


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
