"""Agents as rollouts: ``env.name: agent:<package.module>:<function>``.

The user's agent is a function, written with the ``openai`` client or any framework on top of
it, that plays one episode of a task and returns its outcome. flowrl calls it once per episode
with an ``AgentRollout``: an OpenAI base URL and key bound to this episode's rollout session
(``backends.services.openai_api.sessions``), the task row, and the task's opening (system prompt and
first user message). Every request the agent makes there is sampled by the job's policy and
recorded as tokens; the training trajectories are built from those records
(``agent_loop.recorded``), never from text the agent sends back.

::

    async def run(rollout: AgentRollout) -> float | str:
        client = rollout.client()            # openai.AsyncOpenAI on the session
        answer = await client.chat.completions.create(
            model=rollout.model, messages=rollout.messages()
        )
        return answer.choices[0].message.content   # scored by the task

``env.params`` (``AgentTask``): ``task`` and ``task_params`` name the environment whose rows
the agent plays and whose ``step`` scores a returned answer (any environment name but another
agent); ``reward`` optionally names a function ``(row, result) -> float`` that scores instead;
``timeout_s`` bounds one episode.

The outcome: with ``reward`` set, ``reward(row, result)``; otherwise a number the agent returns
is the episode's reward, and text is its final answer, which the task's environment scores
(``step(answer)``: its reward and ``info``, so ``env.success`` rules work as for the task
itself). Anything else, an exception, or an episode over ``timeout_s`` fails that episode
(``rollout/failed_episodes``), never the job.

A plain ``def`` agent runs in a thread of its own; an ``async def`` agent runs on the rollout's
event loop beside the others, so it must not block that loop (``asyncio.to_thread`` for
blocking work). An agent may share read-only state between episodes; anything it writes is its
own business, and its episodes run concurrently. Warm-up (SFT) uses the task's demonstrations,
so an agent that shows the model the task's opening as it is (``rollout.messages()``) is warmed
up on exactly what it sends.
"""

from __future__ import annotations

import functools
import inspect
import math
import ssl
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

from flowrl.environments.loaded import EnvironmentLoadError
from flowrl.environments.registry import AGENT_PREFIX, import_attribute, make_task
from flowrl.environments.types import DataSource, Environment


@dataclass(frozen=True)
class AgentRollout:
    """What an agent gets for one episode."""

    base_url: str
    """The rollout session's OpenAI base URL (``…/sessions/<id>/v1``): give it to any client."""
    api_key: str
    """The session's key: valid for this episode only, and only at ``base_url``."""
    row: dict[str, Any]
    """The task row (the same for every episode of one GRPO group)."""
    system_prompt: str
    """The task environment's system prompt ("" for none)."""
    prompt: str
    """The task environment's first user message for ``row``."""
    episode_id: str
    model: str = "policy"
    """The model name to send (the session serves the job's policy under any name)."""
    info: dict[str, Any] = field(default_factory=dict)

    def messages(self) -> list[dict[str, str]]:
        """The task's opening as chat messages: the system prompt (if any), the user message."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": self.prompt}]

    def client(self, **kwargs: Any) -> Any:
        """An ``openai.AsyncOpenAI`` client on the session (the ``openai`` package is the
        agent's own dependency), on ``http_client()``. No retries by default: a retried request
        would be sampled and recorded twice."""
        import openai

        kwargs.setdefault("max_retries", 0)
        kwargs.setdefault("http_client", self.http_client())
        return openai.AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def http_client(self, asynchronous: bool = True) -> Any:
        """An HTTP client (async, or not) as the ``openai`` package builds its own, but on one
        TLS context shared by every episode of the process: a client of its own loads the
        system's CA certificates again (~17 ms of CPU; for 64 episodes a step, the rollout's
        main cost). For a framework's client, e.g. ``ChatOpenAI(http_async_client=...)``."""
        import openai

        build = openai.DefaultAsyncHttpxClient if asynchronous else openai.DefaultHttpxClient
        return build(verify=_tls_context())


class AgentTask(BaseModel):
    """``env.params`` of an agent: the task it plays, how it is scored, its time limit. The
    agent function itself is the class's (``agent_task_class``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    agent: ClassVar[Callable[[AgentRollout], Any]]
    agent_name: ClassVar[str]

    task: str = Field(
        default="arithmetic",
        description="The environment whose rows the agent plays and whose step(answer) scores "
        "a returned answer (any env.name but an agent).",
    )
    task_params: dict[str, Any] = Field(
        default_factory=dict, description="That environment's env.params."
    )
    reward: str | None = Field(
        default=None,
        description="package.module:function (row, result) -> float scoring every episode; "
        "unset = the agent's number, or the task's score of its text.",
    )
    timeout_s: float = Field(
        default=120.0, gt=0, le=86_400, description="Seconds one episode may take."
    )

    @field_validator("task")
    @classmethod
    def _not_an_agent(cls, task: str) -> str:
        if task.startswith(AGENT_PREFIX):
            raise ValueError("an agent's task is an environment, not another agent")
        return task

    @field_validator("reward")
    @classmethod
    def _reward_loads(cls, reward: str | None) -> str | None:
        if reward is not None:
            _function(reward, "env.params.reward")
        return reward

    def model_post_init(self, _context: Any) -> None:
        self.inner  # noqa: B018 - the task loads and validates its params now, before a job

    @cached_property
    def inner(self) -> Any:
        """The task config of ``task`` (its rows, demonstrations and environments)."""
        return make_task(self.task, self.task_params)

    @property
    def environment_class(self) -> Any:
        """The agent function (lineage hashes its source file)."""
        return type(self).agent

    def make_env(self) -> Environment:
        """A fresh environment of the task: the episode's opening and its score."""
        return self.inner.make_env()

    def train_source(self, start: int = 0) -> DataSource:
        return self.inner.train_source(start)

    def eval_set(self) -> list[dict[str, Any]]:
        return self.inner.eval_set()

    def sft_example(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        return self.inner.sft_example(row)

    def score(self, env: Environment, row: dict[str, Any], result: Any) -> tuple[float, dict]:
        """The episode's reward and ``info`` from what the agent returned (module docstring);
        ``env`` is the episode's environment, reset on ``row``. Raises ``ValueError`` naming
        what is wrong with ``result``."""
        if self.reward is not None:
            return _finite(_function(self.reward, "env.params.reward")(row, result)), {}
        if isinstance(result, bool | int | float):
            return _finite(result), {}
        if isinstance(result, str):
            step = env.step(result)
            return _finite(step.reward), dict(step.info)
        raise ValueError(
            f"the agent returned {type(result).__name__}: return a reward (a number) or the "
            "final answer (text), or set env.params.reward"
        )


@functools.cache
def _tls_context() -> ssl.SSLContext:
    return ssl.create_default_context()


def agent_task_class(target: str) -> type[AgentTask]:
    """The task-config class of the agent ``package.module:function`` (``env.name`` without
    its prefix). Raises ``ValueError`` naming why it cannot be the agent."""
    function = _function(target, "the agent")
    if inspect.isclass(function) or not callable(function):
        raise ValueError(f"{target!r} is not a function (an agent is a function of a rollout)")
    name = target.replace(".", "_").replace(":", "__")
    cls = type(f"Agent_{name}", (AgentTask,), {"__module__": __name__})
    cls.agent = staticmethod(function)  # type: ignore[assignment]
    cls.agent_name = target  # type: ignore[misc]
    return cls


def _function(target: str, what: str) -> Callable[..., Any]:
    try:
        return import_attribute(target)
    except EnvironmentLoadError as err:
        why = str(err).removeprefix(f"environment {target!r}: ")
        raise ValueError(f"{what} {target!r}: {why}") from None


def _finite(value: Any) -> float:
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"the episode's reward is {reward}: it must be a finite number")
    return reward
