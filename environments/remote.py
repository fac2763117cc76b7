"""Where an episode's environment runs: in-process, in a pool of Ray actors, or behind the HTTP
service (``flowrl.environments.service``) — chosen by ``env.mode`` in the job config.

All three build the environment the same way (registry name + parameters + data row), so with a
fixed seed an episode gives the same trajectory in every mode. A remote failure (service down,
actor dead, environment raising) raises from ``reset``/``step``: the agent loop then fails that
episode alone and the job goes on. Images an environment shows (``get_images``) come back
with each answer (as base64 on the HTTP wire, ``environments.types.to_wire``).

Every ``reset`` and ``step`` has ``step_timeout_s`` seconds (``env.step_timeout_s``); an overrun
raises ``EnvTimeoutError`` (that episode fails) in every mode. What a hung call keeps: ``local``
runs each call in a daemon thread of its own (``environments.timeouts.TimedEnv``), which runs on
until the call returns; ``ray`` kills the actor that hosts it when the factory closes (its other
episodes have ended by then; actors are threaded, so they went on meanwhile) and the pool's next
use starts a fresh actor under its name; ``http`` leaves the deadline to the service, which
answers 504 and drops the episode, and the client waits ``HTTP_MARGIN_S`` longer for that.
"""

from __future__ import annotations

import os
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
import ray

from flowrl.environments.plugin import first_user_message
from flowrl.environments.registry import env_builder, make_env
from flowrl.environments.timeouts import (
    DEFAULT_STEP_TIMEOUT_S,
    EnvTimeoutError,
    TimedEnv,
    timeout_message,
)
from flowrl.environments.types import (
    Environment,
    StepResult,
    from_wire,
    shown_images,
    step_fields,
    to_wire,
)
from flowrl.infra.settings import RAY_NAMESPACE

EnvMode = Literal["local", "ray", "http"]

HTTP_MARGIN_S = 10.0
"""How much longer than ``step_timeout_s`` an ``http`` client waits for the service's answer
(the service enforces the deadline; this bounds a service that stopped answering at all)."""
READY_TIMEOUT_S = 120.0
"""How long a factory waits for its pool's actors to start before it times their calls."""
ENV_ACTOR_THREADS = 32
"""Calls one environment actor runs at once: a hung call does not hold up its other episodes."""


class RemoteEnvError(RuntimeError):
    """A remote environment could not answer (the episode fails; the job goes on)."""


@dataclass
class _Remote:
    """Shared state of a proxy: the episode's opening, and whether it is over."""

    episode_id: str
    system_prompt: str = ""
    first_message: str = ""
    done: bool = False
    images: list[bytes] = field(default_factory=list)
    """Images shown with the latest observation."""

    def get_system_prompt(self) -> str:
        return self.system_prompt

    def get_initial_user_message(self) -> str:
        return self.first_message

    def get_images(self) -> list[bytes]:
        return list(self.images)


@dataclass
class HTTPEnv(_Remote):
    """An episode hosted by the HTTP environment service."""

    client: httpx.Client = field(default=None, repr=False)  # type: ignore[assignment]
    job: str = ""
    spec: dict[str, Any] = field(default_factory=dict)
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    """Sent with the reset: the service gives each call of the episode this long."""

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            response = self.client.post(path, json=body)
        except httpx.TimeoutException as exc:
            waited = timeout_message(path.strip("/"), self.step_timeout_s + HTTP_MARGIN_S)
            raise EnvTimeoutError(f"{waited} (no answer from the environment service)") from exc
        except httpx.HTTPError as exc:
            raise RemoteEnvError(f"environment service unreachable: {exc!r}") from exc
        if response.status_code == 504:  # the service's deadline: the episode is dropped there
            raise EnvTimeoutError(_detail(response))
        if response.status_code != 200:
            raise RemoteEnvError(f"environment service {response.status_code}: {response.text}")
        return response.json()

    def reset(self, **row: Any) -> str:
        body = {"job": self.job, "episode_id": self.episode_id, "env": self.spec}
        body |= {"step_timeout_s": self.step_timeout_s}
        answer = self._post("/reset", body | {"row": to_wire(row)})
        self.system_prompt, self.first_message = answer["system_prompt"], answer["observation"]
        self.images = from_wire(answer.get("images", []))
        return self.first_message

    def step(self, action: str) -> StepResult:
        body = {"job": self.job, "episode_id": self.episode_id, "action": action}
        answer = self._post("/step", body)
        self.images = from_wire(answer.pop("images", []))
        result = StepResult(**answer)
        self.done = result.done
        return result

    def close(self) -> None:
        if not self.done:
            try:
                self.client.delete(f"/episodes/{self.job}/{self.episode_id}")
            except httpx.HTTPError:
                pass  # the service is gone: nothing left to free


def _detail(response: httpx.Response) -> str:
    """The one-line reason of an error answer (its ``detail``), else its text."""
    try:
        return str(response.json()["detail"])
    except (ValueError, KeyError, TypeError):
        return response.text


class EnvActor:
    """A Ray actor hosting many episodes (the ``ray`` mode's pool member); threaded
    (``ENV_ACTOR_THREADS``), each episode called by one caller at a time."""

    def __init__(self) -> None:
        self.episodes: dict[str, Environment] = {}

    def prepare(self, spec: dict[str, Any]) -> bool:
        """Import the environment and validate its params once, before any call is timed."""
        env_builder(spec["name"], spec["params"])
        return True

    def reset(
        self, episode_id: str, spec: dict[str, Any], row: dict[str, Any]
    ) -> tuple[str, str, list[bytes]]:
        """(first observation, system prompt, images shown with it)."""
        env = make_env(spec["name"], spec["params"])
        observation = first_user_message(env, env.reset(**row))
        self.episodes[episode_id] = env
        return observation, env.get_system_prompt(), shown_images(env)

    def step(self, episode_id: str, action: str) -> dict[str, Any]:
        """The ``StepResult`` as a dict, plus ``images`` shown with its observation."""
        env = self.episodes[episode_id]
        result = env.step(action)
        if result.done:
            self.episodes.pop(episode_id, None)
        return step_fields(result) | {"images": [] if result.done else shown_images(env)}

    def end(self, episode_id: str) -> None:
        self.episodes.pop(episode_id, None)

    def live(self) -> int:
        return len(self.episodes)


@dataclass
class RayEnv(_Remote):
    """An episode hosted by one actor of a Ray pool."""

    actor: Any = field(default=None, repr=False)
    spec: dict[str, Any] = field(default_factory=dict)
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    on_timeout: Callable[[Any], None] | None = field(default=None, repr=False)
    """Told the actor of a call that overran (the factory kills it when it closes)."""

    def _call(self, verb: str, *args: Any) -> Any:
        try:
            return ray.get(getattr(self.actor, verb).remote(*args), timeout=self.step_timeout_s)
        except ray.exceptions.GetTimeoutError:
            if self.on_timeout is not None:
                self.on_timeout(self.actor)
            raise EnvTimeoutError(timeout_message(verb, self.step_timeout_s)) from None
        except (ray.exceptions.RayError, KeyError) as exc:
            raise RemoteEnvError(f"environment actor failed: {exc}") from exc

    def reset(self, **row: Any) -> str:
        self.first_message, self.system_prompt, self.images = self._call(
            "reset", self.episode_id, self.spec, row
        )
        return self.first_message

    def step(self, action: str) -> StepResult:
        answer = self._call("step", self.episode_id, action)
        self.images = answer.pop("images", [])
        result = StepResult(**answer)
        self.done = result.done
        return result

    def close(self) -> None:
        if not self.done:
            self.actor.end.remote(self.episode_id)


def env_pool(pool_name: str, size: int) -> list[Any]:
    """The ``size`` actors of a named pool, started on first use (they outlive one task)."""
    actor_cls = ray.remote(num_cpus=0, max_concurrency=ENV_ACTOR_THREADS)(EnvActor)
    return [
        actor_cls.options(
            name=f"{pool_name}-{i}",
            namespace=RAY_NAMESPACE,
            get_if_exists=True,
            lifetime="detached",
        ).remote()
        for i in range(size)
    ]


def kill_env_actor(actor: Any, name: str, wait_s: float = 30.0) -> None:
    """Kill a pool member (a call of it hung) and wait until its name is free, so the pool's
    next use (``env_pool``) starts a fresh actor in its place."""
    ray.kill(actor, no_restart=True)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        try:
            if ray.get_actor(name, namespace=RAY_NAMESPACE)._actor_id != actor._actor_id:
                return  # already replaced
        except ValueError:
            return  # gone: the name is free
        time.sleep(0.05)


def stop_env_pool(pool_name: str, size: int) -> None:
    for i in range(size):
        try:
            ray.kill(ray.get_actor(f"{pool_name}-{i}", namespace=RAY_NAMESPACE))
        except ValueError:
            pass  # never started or already gone


KEY_VAR = "FLOWRL_ENV_SERVICE_KEY"
"""The API key an ``http``-mode job sends to the environment service (an environment variable
of the job's processes, never a config field)."""
DEPRECATED_KEY_VAR = "FLOWRL_ENV_SERVICE_TOKEN"


def service_key() -> str:
    """The key this process sends (``FLOWRL_ENV_SERVICE_KEY``; the old
    ``FLOWRL_ENV_SERVICE_TOKEN`` still works, with a warning)."""
    key = os.environ.get(KEY_VAR, "")
    if not key and os.environ.get(DEPRECATED_KEY_VAR):
        warnings.warn(
            f"{DEPRECATED_KEY_VAR} is deprecated; set {KEY_VAR} instead",
            FutureWarning,
            stacklevel=2,
        )
        key = os.environ[DEPRECATED_KEY_VAR]
    return key


class EnvFactory:
    """Builds one environment per episode id in the configured mode; ``close()`` frees the
    remote episodes that ended without the environment saying done (turn or token caps)."""

    def __init__(
        self,
        name: str,
        params: dict[str, Any],
        mode: EnvMode = "local",
        job: str = "local",
        service_url: str | None = None,
        ray_actors: int = 2,
        timeout_s: float | None = None,
        step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
    ):
        """``step_timeout_s``: seconds each reset and step may take; ``timeout_s``: the
        ``http`` client's own limit (default ``step_timeout_s + HTTP_MARGIN_S``)."""
        self.spec = {"name": name, "params": params}
        self.mode, self.job, self.step_timeout_s = mode, job, step_timeout_s
        self._made: list[Any] = []
        self._build = env_builder(name, params) if mode == "local" else None
        key = service_key()
        headers = {"X-API-Key": key} if key else {}
        client_timeout = timeout_s if timeout_s is not None else step_timeout_s + HTTP_MARGIN_S
        self._client = (
            httpx.Client(base_url=service_url, timeout=client_timeout, headers=headers)
            if mode == "http"
            else None
        )
        self._pool = f"{job}-envs"
        self._actors = env_pool(self._pool, ray_actors) if mode == "ray" else []
        self._hung: set[int] = set()  # indices of actors a call of which overran
        if self._actors:  # started and the environment imported: start-up is not timed
            ready = [a.prepare.remote(self.spec) for a in self._actors]
            ray.wait(ready, num_returns=len(ready), timeout=READY_TIMEOUT_S)

    def __call__(self, episode_id: str) -> Environment:
        if self.mode == "local":
            return TimedEnv(self._build(), self.step_timeout_s)
        if self.mode == "http":
            env: Any = HTTPEnv(
                episode_id,
                client=self._client,
                job=self.job,
                spec=self.spec,
                step_timeout_s=self.step_timeout_s,
            )
        else:
            index = zlib.crc32(episode_id.encode()) % len(self._actors)
            env = RayEnv(
                episode_id,
                actor=self._actors[index],
                spec=self.spec,
                step_timeout_s=self.step_timeout_s,
                on_timeout=lambda _actor, i=index: self._hung.add(i),
            )
        self._made.append(env)
        return env

    def close(self) -> None:
        """End the episodes still open; in ``ray`` mode kill each actor a call of which hung
        (its hung thread goes with it; the pool's next use starts a fresh one by name)."""
        for env in self._made:
            env.close()
        self._made.clear()
        for index in sorted(self._hung):
            kill_env_actor(self._actors[index], f"{self._pool}-{index}")
        self._hung.clear()
        if self._client is not None:
            self._client.close()


def env_factory_for(env_section: Any, job: str) -> Callable[[str], Environment]:
    """An ``EnvFactory`` from the job config's ``env`` section."""
    return EnvFactory(
        env_section.name,
        env_section.params,
        mode=env_section.mode,
        job=job,
        service_url=env_section.service_url,
        ray_actors=env_section.ray_actors,
        step_timeout_s=env_section.step_timeout_s,
    )
