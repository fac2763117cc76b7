"""Data contracts of the environment layer.

An environment is a small pure-Python object (no torch, no tokenizer) that speaks text:
the agent loop turns its text into tokens. Every record here is picklable so that it can
cross Ray and Prefect boundaries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one action of the policy."""

    observation: str
    """Text shown to the policy next (empty when the episode is over)."""
    reward: float
    """Reward earned by this action."""
    done: bool
    """True when the episode is over."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form diagnostics (e.g. ``{"correct": True}``); must be JSON-serialisable."""


@runtime_checkable
class Environment(Protocol):
    """The environment API of OpenTinker: text in, text out.

    ``reset`` starts an episode from a data row (keyword arguments) and returns the first user
    message; ``step`` takes the policy's decoded action for one turn.
    """

    def reset(self, **kwargs: Any) -> str: ...

    def step(self, action: str) -> StepResult: ...

    def get_system_prompt(self) -> str: ...

    def get_initial_user_message(self) -> str: ...


@runtime_checkable
class DataSource(Protocol):
    """An endless, resumable stream of data rows (dicts passed to ``Environment.reset``).

    ``state()`` is a small JSON-serialisable cursor that a checkpoint saves; after
    ``load_state(s)`` the source yields exactly the rows it yielded after ``s`` was taken.
    """

    def next_batch(self, n: int) -> list[dict[str, Any]]: ...

    def state(self) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...
