"""A user's environment class as a task config: data rows, held-out set and demonstrations.

The user writes only the environment API (``environments.types.Environment``); this wrapper
supplies what the stages need around it:

- **rows.** With ``env.data.train`` / ``env.data.eval`` files (JSONL, JSON or parquet, local or
  ``s3://``), each row's fields go to ``reset(**row)``; the training stream is reshuffled every
  epoch from the job's seed and its cursor is checkpointed. Without files, rows are generated:
  training rows ``{"seed": n}`` with ``n`` counting up from ``train_seed_start(job seed)``, and
  the held-out rows ``{"seed": m}`` for ``m`` in ``0 .. eval_size - 1``: disjoint from training.
- **demonstrations** (warm-up SFT). An environment may define
  ``demonstration(**row) -> list[str]``: the assistant turns of a good episode for that row.
  flowrl plays them through a fresh environment, so the conversation holds exactly the
  observations the environment answers (tool results included) and stops when it is done.
"""

from __future__ import annotations

from typing import Any

from flowrl.environments.data import GeneratedSource, StaticSource, load_rows
from flowrl.environments.loaded import Loaded, construct
from flowrl.environments.types import OBSERVATION_ROLE_KEY, DataSource, Environment

TRAIN_SEED_SPACING = 1_000_000
"""Generated training seeds of job seed ``s`` start at ``(s + 1) * TRAIN_SEED_SPACING``;
held-out seeds are ``0 .. eval_size - 1`` (``eval_size`` is at most ``TRAIN_SEED_SPACING``)."""
DEMONSTRATION = "demonstration"
"""Name of the optional environment method returning a demonstration's assistant turns."""


def train_seed_start(job_seed: int) -> int:
    """The first generated training seed of a job: never a held-out seed."""
    return (abs(int(job_seed)) + 1) * TRAIN_SEED_SPACING


class PluginTask:
    """The task config of an environment given as a class (``environments.registry``)."""

    def __init__(
        self, loaded: Loaded, params: dict[str, Any], data: Any, eval_size: int, seed: int
    ) -> None:
        if not 1 <= eval_size <= TRAIN_SEED_SPACING:
            raise ValueError(f"env.eval_size must be in 1..{TRAIN_SEED_SPACING}, got {eval_size}")
        self.loaded, self.params, self.seed = loaded, params, seed
        self.train_uri = getattr(data, "train", None)
        self.eval_uri = getattr(data, "eval", None)
        if self.train_uri and not self.eval_uri:
            raise ValueError("env.data.train is set: set env.data.eval too (the held-out rows)")
        if self.eval_uri and not self.train_uri:
            raise ValueError("env.data.eval is set: set env.data.train too (the training rows)")
        self.eval_size = eval_size

    @property
    def environment_class(self) -> Any:
        """The user's class or factory (lineage hashes its source file)."""
        return self.loaded.target

    @property
    def has_demonstrations(self) -> bool:
        return callable(getattr(self.loaded.target, DEMONSTRATION, None))

    def make_env(self) -> Environment:
        return construct(self.loaded, self.params)

    def train_source(self, start: int = 0) -> DataSource:
        if self.train_uri:
            return StaticSource.from_uri(self.train_uri, seed=self.seed)
        first = train_seed_start(self.seed)
        return GeneratedSource(lambda i: {"seed": first + i}, start=start)

    def eval_set(self) -> list[dict[str, Any]]:
        if self.eval_uri:
            return load_rows(self.eval_uri)
        return [{"seed": m} for m in range(self.eval_size)]

    def sft_example(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """The environment's demonstration for ``row``, played through a fresh environment.
        Raises ``ValueError`` when the environment has no ``demonstration`` method or its
        demonstration is not a list of strings."""
        env = self.make_env()
        demonstrate = getattr(env, DEMONSTRATION, None)
        if not callable(demonstrate):
            raise ValueError(f"environment {self.loaded.name!r} has no {DEMONSTRATION}() method")
        actions = demonstrate(**row)
        if not isinstance(actions, list) or not all(isinstance(a, str) for a in actions):
            raise ValueError(
                f"environment {self.loaded.name!r}: {DEMONSTRATION}() must return a list of "
                f"strings (the assistant turns), got {type(actions).__name__}"
            )
        return play(env, row, actions)


def first_user_message(env: Environment, reset_value: Any) -> str:
    """The episode's first user message: what ``reset`` returned when it is a non-empty
    string, else ``get_initial_user_message()``."""
    if isinstance(reset_value, str) and reset_value:
        return reset_value
    message = env.get_initial_user_message()
    if not isinstance(message, str):
        raise TypeError(
            f"reset returned {type(reset_value).__name__} and get_initial_user_message "
            f"returned {type(message).__name__}: one of them must return the first user message"
        )
    return message


def play(env: Environment, row: dict[str, Any], actions: list[str]) -> list[dict[str, Any]]:
    """The conversation of ``actions`` played from ``reset(**row)``: system prompt (if any),
    first user message, then each action and the observation it gets, until done."""
    user = first_user_message(env, env.reset(**row))
    system = env.get_system_prompt()
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    for action in actions:
        messages.append({"role": "assistant", "content": action})
        result = env.step(action)
        if result.done:
            break
        role = (result.info or {}).get(OBSERVATION_ROLE_KEY, "user")
        messages.append({"role": role, "content": result.observation})
    return messages
