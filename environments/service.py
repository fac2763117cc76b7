"""Environments as a service: an HTTP API (FastAPI) hosting episodes keyed by job and episode id.

    flowrl serve environments --host 127.0.0.1 --port 8765 \
        [--env tool_math --env mypkg.envs:MyEnv ...]

Endpoints (JSON):
- ``POST /reset``  {job, episode_id, env: {name, params}, row} → {observation, system_prompt,
  images}
- ``POST /step``   {job, episode_id, action} → {observation, reward, done, info, images}

Bytes (images in rows, images shown with an observation) travel as ``{"$base64": "..."}``
(``environments.types.to_wire`` / ``from_wire``).
- ``DELETE /episodes/{job}/{episode_id}`` → ends an episode early
- ``GET /stats``   → {"episodes": live episodes, "jobs": {job: live episodes}, "steps": total}
- ``GET /health``

Environments are built from the registry by name (``environments.registry``): a client sends
data (a name, parameters and a data row), never code. The service serves the names it was
started with (``--env``, repeatable: an installed entry point's name or ``package.module:Class``
importable here), or, with none, every installed environment (entry points
``flowrl.environments``); any other name is refused with 403 before anything is imported.
An environment that raises answers 500 with the error text, so the client's episode fails and
the others go on. Each ``reset`` and ``step`` gets the ``step_timeout_s`` the client sent with
the reset, at most ``--step-timeout`` seconds: an overrun answers 504 ("step timed out after
60 s") and drops the episode; the call's thread cannot be killed and runs on until it returns,
its result dropped (``environments.timeouts``).

Tenancy and limits (a multi-tenant service on a network), through the serving layer every flowrl
service shares (``infra.serving``):

- **Keys.** ``X-API-Key: <key>`` (or ``Authorization: Bearer <key>``) on every call but
  ``/health``; keys come from ``--keys-file`` (lines ``namespace:key``) or
  ``FLOWRL_ENV_SERVICE_KEYS`` (``namespace:key,namespace:key``), never from a job config. A
  client (``env.mode: http``) sends ``FLOWRL_ENV_SERVICE_KEY``. Without keys the service starts
  only with ``--insecure-loopback`` on a loopback address, where every caller is one owner.
  (The old names ``--tokens-file``, ``FLOWRL_ENV_SERVICE_TOKENS``, ``FLOWRL_ENV_SERVICE_TOKEN``
  and ``--max-*-per-owner`` still work, with a deprecation warning.)
- **Namespaces.** An episode belongs to the namespace that reset it: another gets 404 on step
  and delete, and ``/stats`` shows a caller only its own episodes.
- **Limits.** Request bodies at most ``--max-body-bytes`` (413; a body without Content-Length:
  411); optionally ``--max-requests-per-second`` per namespace (429); per namespace at most
  ``--max-episodes-per-namespace`` live episodes and ``--max-bytes-per-namespace`` bytes of
  requests held by them (429); episodes idle for ``--episode-ttl`` seconds are dropped;
  uvicorn's concurrency, keep-alive and header-size limits are set. Every malformed request is
  a 4xx ``{"detail": …}`` with a one-line reason, never a traceback.
  Request handlers run in a thread pool: the episode table is read and changed under one lock,
  and a reset reserves its slot (limits checked and slot taken in one step) before it builds
  the environment, so concurrent resets never pass a limit together.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, Field

from flowrl.environments.loaded import EnvironmentLoadError
from flowrl.environments.plugin import first_user_message
from flowrl.environments.registry import env_builder, installed_names, load
from flowrl.environments.timeouts import DEFAULT_STEP_TIMEOUT_S, EnvTimeoutError, call_with_timeout
from flowrl.environments.types import (
    Environment,
    from_wire,
    shown_images,
    step_fields,
    to_wire,
)
from flowrl.infra.serving import (
    Keys,
    ServiceError,
    ServingLimits,
    add_serving_arguments,
    check_exposure,
    guarded_app,
    read_keys,
    serve,
)

_ID = Field(min_length=1, max_length=256)


class EnvSpec(BaseModel):
    name: str = Field(min_length=1, max_length=256, description="Registered environment name.")
    params: dict[str, Any] = Field(default_factory=dict, description="Its task parameters.")


class ResetRequest(BaseModel):
    job: str = _ID
    episode_id: str = _ID
    env: EnvSpec
    row: dict[str, Any] = Field(default_factory=dict)
    step_timeout_s: float | None = Field(
        default=None, gt=0, le=86_400, description="Seconds each reset and step may take."
    )


class StepRequest(BaseModel):
    job: str = _ID
    episode_id: str = _ID
    action: str


KEYS_VAR = "FLOWRL_ENV_SERVICE_KEYS"
DEPRECATED_KEYS_VAR = "FLOWRL_ENV_SERVICE_TOKENS"


@dataclass
class Limits(ServingLimits):
    """What one service accepts (see the module docstring)."""

    max_episodes: int = 100_000
    max_episodes_per_namespace: int = 10_000
    max_bytes_per_namespace: int = 256 * 2**20
    episode_ttl_s: float = 900.0
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    """The longest a reset or step may take, whatever a client asks."""


BAD_ROW = (ValueError, TypeError, KeyError, AttributeError, RecursionError)
"""What a reset raises for a row or parameters it cannot take: a 400, not the service's fault."""

Key = tuple[str | None, str, str]
"""(namespace, job, episode id)."""


@dataclass
class _Episode:
    env: Environment | None
    """None while its reset runs (the slot is reserved)."""
    namespace: str | None
    job: str
    nbytes: int
    timeout_s: float
    used: float = field(default_factory=time.monotonic)


class EpisodeTable:
    """The live episodes, each namespace's share of them and its step count. Request handlers
    run in a thread pool: every read and change is under one lock, and a reset reserves its
    slot (limits checked and slot taken in one step) before its environment is built."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.episodes: dict[Key, _Episode] = {}
        self.steps: Counter[str | None] = Counter()
        self.held: Counter[str | None] = Counter()  # bytes of requests held by live episodes
        self.live: Counter[str | None] = Counter()
        self.swept = 0.0
        self.lock = threading.Lock()

    def sweep(self) -> None:
        """Drop the episodes idle past the TTL (at most once a second)."""
        now = time.monotonic()
        with self.lock:
            if now - self.swept < 1.0:
                return
            self.swept = now
            idle = [k for k, e in self.episodes.items() if now - e.used > self.limits.episode_ttl_s]
            for key in idle:
                self._drop_locked(key)

    def _drop_locked(self, key: Key, only: _Episode | None = None) -> bool:
        if only is not None and self.episodes.get(key) is not only:
            return False
        gone = self.episodes.pop(key, None)
        if gone is not None:
            self.held[gone.namespace] -= gone.nbytes
            self.live[gone.namespace] -= 1
        return gone is not None

    def drop(self, key: Key, only: _Episode | None = None) -> bool:
        """Drop an episode (``only``: if it is still that one); whether one was dropped."""
        with self.lock:
            return self._drop_locked(key, only)

    def get(self, key: Key) -> _Episode:
        """A live episode whose reset has finished (404 otherwise); marks it used."""
        with self.lock:
            found = self.episodes.get(key)
            if found is None or found.env is None:
                raise ServiceError(404, f"no live episode {key[2]!r} of job {key[1]!r}")
            found.used = time.monotonic()
            return found

    def reserve(self, key: Key, nbytes: int, asked_timeout_s: float | None) -> _Episode:
        """Check the limits and take the episode's slot in one step (a reset replaces the
        caller's own episode of that id)."""
        limits, namespace = self.limits, key[0]
        timeout_s = min(asked_timeout_s or limits.step_timeout_s, limits.step_timeout_s)
        with self.lock:
            self._drop_locked(key)
            if len(self.episodes) >= limits.max_episodes:
                raise ServiceError(503, f"too many live episodes ({limits.max_episodes})")
            if self.live[namespace] >= limits.max_episodes_per_namespace:
                raise ServiceError(
                    429, f"at most {limits.max_episodes_per_namespace} live episodes"
                )
            if self.held[namespace] + nbytes > limits.max_bytes_per_namespace:
                raise ServiceError(
                    429, f"live episodes hold over {limits.max_bytes_per_namespace} bytes"
                )
            slot = _Episode(None, namespace, key[1], nbytes, timeout_s)
            self.episodes[key] = slot
            self.held[namespace] += nbytes
            self.live[namespace] += 1
            return slot

    @contextmanager
    def failing(self, key: Key, slot: _Episode, what: str) -> Iterator[None]:
        """Any failure of the episode's call drops it (if it is still ``slot``) and answers a
        4xx/5xx naming it: the episode fails, not the service."""
        try:
            yield
        except ServiceError:
            self.drop(key, only=slot)
            raise
        except EnvTimeoutError as exc:  # the call's thread runs on; its result is dropped
            self.drop(key, only=slot)
            raise ServiceError(504, str(exc)) from None
        except Exception as exc:
            self.drop(key, only=slot)
            if what == "reset" and isinstance(exc, BAD_ROW):  # the row or parameters are wrong
                raise ServiceError(400, f"reset refused: {str(exc)[:300]}") from None
            raise ServiceError(500, f"{what} failed: {exc!r}"[:300]) from None

    def opened(self, key: Key, slot: _Episode, env: Environment) -> None:
        """The reset finished: the slot holds its environment, unless it was ended meanwhile."""
        with self.lock:
            if self.episodes.get(key) is not slot:  # deleted, swept or reset again meanwhile
                raise ServiceError(409, f"episode {key[2]!r} was ended during its reset")
            slot.env, slot.used = env, time.monotonic()

    def stepped(self, key: Key, found: _Episode, done: bool) -> None:
        with self.lock:
            self.steps[key[0]] += 1
            if done:
                self._drop_locked(key, only=found)

    def stats(self, namespace: str | None) -> dict[str, Any]:
        """What a namespace sees: its own live episodes by job, and its steps."""
        with self.lock:
            jobs = Counter(e.job for e in self.episodes.values() if e.namespace == namespace)
            steps = self.steps[namespace]
        return {"episodes": sum(jobs.values()), "jobs": dict(jobs), "steps": steps}


def create_app(
    serves: list[str] | None = None,
    keys: dict[str, str] | None = None,
    limits: Limits | None = None,
) -> FastAPI:
    """The service; episodes live in this process's memory until done, deleted or idle past
    the TTL. ``serves``: the environment names it builds (default: every installed one); each
    is loaded now, so a name that does not load stops the service at start, not at a job's
    first episode. ``keys``: key → namespace; None or empty = no authentication (``main``
    allows that only on loopback with ``--insecure-loopback``)."""
    limits = limits or Limits()
    served = sorted(set(serves)) if serves else installed_names()
    for name in served:
        load(name)
    table = EpisodeTable(limits)
    app = guarded_app(
        "flowrl environments", Keys(keys), limits, open_paths={"/health"}, on_request=table.sweep
    )

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/reset")
    def reset(req: ResetRequest, request: Request) -> dict[str, Any]:
        key = (request.state.namespace, req.job, req.episode_id)
        nbytes = int(request.headers["content-length"])
        slot = table.reserve(key, nbytes, req.step_timeout_s)
        with table.failing(key, slot, "reset"):
            if req.env.name not in served:
                raise ServiceError(
                    403, f"environment {req.env.name!r} is not served here; served: {served}"
                )
            params = json.dumps(req.env.params, sort_keys=True)
            env, answer = call_with_timeout(
                _open, slot.timeout_s, "reset", req.env.name, params, req.row
            )
        table.opened(key, slot, env)
        return answer

    @app.post("/step")
    def step(req: StepRequest, request: Request) -> dict[str, Any]:
        key = (request.state.namespace, req.job, req.episode_id)
        found = table.get(key)
        with table.failing(key, found, "step"):
            result, images = call_with_timeout(
                _step, found.timeout_s, "step", found.env, req.action
            )
        table.stepped(key, found, result.done)
        return step_fields(result) | {"images": to_wire(images)}

    @app.delete("/episodes/{job}/{episode_id}")
    def end(job: str, episode_id: str, request: Request) -> dict[str, bool]:
        if not table.drop((request.state.namespace, job, episode_id)):
            raise ServiceError(404, f"no live episode {episode_id!r} of job {job!r}")
        return {"ended": True}

    @app.get("/stats")
    def stats(request: Request) -> dict[str, Any]:
        return table.stats(request.state.namespace)

    return app


def _open(name: str, params_json: str, row: dict[str, Any]) -> tuple[Environment, dict[str, Any]]:
    """Build and reset an episode's environment: (it, the reset's answer)."""
    env = _builder(name, params_json)()
    observation = first_user_message(env, env.reset(**from_wire(row)))
    images = shown_images(env)
    answer = {
        "observation": observation,
        "system_prompt": env.get_system_prompt(),
        "images": to_wire(images),
    }
    return env, answer


def _step(env: Environment, action: str) -> tuple[Any, list[bytes]]:
    """One step and the images shown with its observation."""
    result = env.step(action)
    return result, [] if result.done else shown_images(env)


@lru_cache(maxsize=256)
def _builder(name: str, params_json: str) -> Callable[[], Environment]:
    """Validated once per (name, params): a repeated request costs no validation CPU."""
    return env_builder(name, json.loads(params_json))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``flowrl serve environments``: the shared ones, then the service's own."""
    add_serving_arguments(parser, 8765, KEYS_VAR, Limits.max_body_bytes)
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        help="an environment to serve (entry point name or package.module:Class); repeatable. "
        "Default: every installed environment.",
    )
    parser.add_argument(
        "--max-episodes-per-namespace", type=int, default=Limits.max_episodes_per_namespace
    )
    parser.add_argument(
        "--max-bytes-per-namespace", type=int, default=Limits.max_bytes_per_namespace
    )
    parser.add_argument("--episode-ttl", type=float, default=Limits.episode_ttl_s)
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=Limits.step_timeout_s,
        help="the longest one reset or step may take (a client may ask for less); 504 after",
    )
    # the names of before the serving layer, kept working with a warning
    parser.add_argument("--tokens-file", help=argparse.SUPPRESS)
    parser.add_argument("--max-episodes-per-owner", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--max-bytes-per-owner", type=int, help=argparse.SUPPRESS)


def _renamed(args: argparse.Namespace) -> None:
    """Carry the deprecated flags over to their new names, warning on stderr."""
    for old, new in (
        ("tokens_file", "keys_file"),
        ("max_episodes_per_owner", "max_episodes_per_namespace"),
        ("max_bytes_per_owner", "max_bytes_per_namespace"),
    ):
        if getattr(args, old) is not None:
            flag, new_flag = "--" + old.replace("_", "-"), "--" + new.replace("_", "-")
            print(f"warning: {flag} is deprecated; use {new_flag}", file=sys.stderr)
            setattr(args, new, getattr(args, old))


def prepare(args: argparse.Namespace) -> tuple[FastAPI, str]:
    """The app ``args`` ask for, or ``SystemExit`` naming what is wrong (before it serves)."""
    _renamed(args)
    if args.step_timeout <= 0:
        raise SystemExit(f"--step-timeout must be > 0, got {args.step_timeout}")
    keys = read_keys(args.keys_file, [KEYS_VAR], deprecated=[DEPRECATED_KEYS_VAR])
    check_exposure(args.host, keys, args.insecure_loopback)
    limits = Limits(
        max_body_bytes=args.max_body_bytes,
        max_requests_per_s=args.max_requests_per_second,
        max_episodes_per_namespace=args.max_episodes_per_namespace,
        max_bytes_per_namespace=args.max_bytes_per_namespace,
        episode_ttl_s=args.episode_ttl,
        step_timeout_s=args.step_timeout,
    )
    try:
        app = create_app(serves=args.env, keys=keys, limits=limits)
    except EnvironmentLoadError as err:  # a name it may not serve stops it at start
        raise SystemExit(str(err)) from None
    return app, f"http://{args.host}:{args.port}"


def command_parser(prog: str = "flowrl serve environments") -> argparse.ArgumentParser:
    """The command's flags (``flowrl serve environments --help``)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Serve flowrl environments over HTTP (docs/environments.md). Keys "
        f"(namespace:key) from --keys-file or {KEYS_VAR}.",
    )
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Serve until interrupted (``flowrl serve environments``)."""
    parser = command_parser()
    args = parser.parse_args(argv)
    app, url = prepare(args)
    print(f"environment service on {url}", flush=True)
    serve(app, args.host, args.port)


if __name__ == "__main__":
    print(
        "warning: python -m flowrl.environments.service is deprecated; use "
        "flowrl serve environments",
        file=sys.stderr,
    )
    main()
