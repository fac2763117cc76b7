"""Data contracts of the environment layer.

An environment is a small pure-Python object (no torch, no tokenizer) that speaks text:
the agent loop turns its text into tokens. Every record here is picklable so that it can
cross Ray and Prefect boundaries.
"""

from __future__ import annotations

import base64
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


OBSERVATION_ROLE_KEY = "observation_role"
"""``StepResult.info`` key naming the role of the observation's message (``"user"`` when absent,
``"tool"`` for a tool's answer)."""
OBSERVATION_ROLES = ("user", "tool")
"""The observation roles. An environment class may declare the ones it sends as the class
attribute ``observation_roles`` (e.g. ``("user",)``; ``()`` when single-turn), so that the
start-of-job chat-template probe renders only those; undeclared, it may send both."""


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


def step_fields(result: Any) -> dict[str, Any]:
    """A step's answer (``StepResult``, or any object with ``observation``, ``reward``, ``done``
    and ``info``, as a user's environment may return) as the plain dict Ray and HTTP carry."""
    return {
        "observation": str(result.observation),
        "reward": float(result.reward),
        "done": bool(result.done),
        "info": dict(result.info or {}),
    }


@runtime_checkable
class ShowsImages(Protocol):
    """An environment that shows images (to vision-language policies) implements this too.

    ``get_images()`` returns the images shown with the latest observation — the first user
    message after ``reset``, the observation after ``step`` — as encoded bytes (PNG/JPEG), in
    order; ``[]`` when that observation is text only. The agent loop reads it after each reset
    and step; environments without the method show no images.
    """

    def get_images(self) -> list[bytes]: ...


def shown_images(env: Any) -> list[bytes]:
    """The images ``env`` shows with its latest observation ([] if it shows none)."""
    get_images = getattr(env, "get_images", None)
    return [bytes(image) for image in get_images()] if get_images is not None else []


WIRE_BYTES_KEY = "$base64"
"""JSON form of a bytes value on the wire (HTTP service): ``{"$base64": "<base64 text>"}``."""


def to_wire(value: Any) -> Any:
    """``value`` with every bytes inside (dicts, lists) as ``{WIRE_BYTES_KEY: base64}``: JSON."""
    if isinstance(value, bytes | bytearray):
        return {WIRE_BYTES_KEY: base64.b64encode(value).decode("ascii")}
    if isinstance(value, dict):
        return {k: to_wire(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_wire(v) for v in value]
    return value


def from_wire(value: Any) -> Any:
    """Inverse of ``to_wire``."""
    if isinstance(value, dict):
        if set(value) == {WIRE_BYTES_KEY}:
            return base64.b64decode(value[WIRE_BYTES_KEY])
        return {k: from_wire(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_wire(v) for v in value]
    return value


@runtime_checkable
class DataSource(Protocol):
    """An endless, resumable stream of data rows (dicts passed to ``Environment.reset``).

    ``state()`` is a small JSON-serialisable cursor that a checkpoint saves; after
    ``load_state(s)`` the source yields exactly the rows it yielded after ``s`` was taken.
    """

    def next_batch(self, n: int) -> list[dict[str, Any]]: ...

    def state(self) -> dict[str, Any]: ...

    def load_state(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class TaskConfig(Protocol):
    """What a registered environment name resolves to (``environments.registry``): a small
    pydantic model of the environment's parameters (``env.params``) that builds its episodes
    and data. The stages (rollout, eval, warm-up) use only these four methods."""

    def make_env(self) -> Environment:
        """A fresh environment for one episode."""
        ...

    def train_source(self, start: int = 0) -> DataSource:
        """The endless, resumable stream of training rows."""
        ...

    def eval_set(self) -> list[dict[str, Any]]:
        """The fixed held-out rows (disjoint from training)."""
        ...

    def sft_example(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """A demonstration conversation for ``row`` (warm-up SFT); ``NoDemonstration`` when
        the row has none to give."""
        ...


class NoDemonstration(Exception):
    """``sft_example(row)`` has nothing to show for this row (e.g. a game that the reference
    players end before the policy's first move): warm-up draws the next row instead."""
