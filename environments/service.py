"""Environments as a service: an HTTP API (FastAPI) hosting episodes keyed by job and episode id.

    python -m flowrl.environments.service --host 127.0.0.1 --port 8765 \
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

Tenancy and limits (a multi-tenant service on a network):

- **Bearer tokens.** ``Authorization: Bearer <token>`` on every call but ``/health``; tokens
  come from ``--tokens-file`` (lines ``owner:token``) or ``FLOWRL_ENV_SERVICE_TOKENS``
  (``owner:token,owner:token``), never from a job config. A client (``env.mode: http``) sends
  ``FLOWRL_ENV_SERVICE_TOKEN``. Without tokens the service starts only with
  ``--insecure-loopback`` on a loopback address, where every caller is one owner.
- **Ownership.** An episode belongs to the owner that reset it: another owner gets 404 on step
  and delete, and ``/stats`` shows a caller only its own episodes.
- **Limits.** Request bodies at most ``--max-body-bytes`` (413; a body without Content-Length:
  411); per owner at most ``--max-episodes-per-owner`` live episodes and
  ``--max-bytes-per-owner`` bytes of requests held by them (429); episodes idle for
  ``--episode-ttl`` seconds are dropped; uvicorn's concurrency, keep-alive and header-size limits
  are set. Every malformed request is a 4xx with a one-line reason, never a traceback.
  Request handlers run in a thread pool: the episode table is read and changed under one lock,
  and a reset reserves its slot (limits checked and slot taken in one step) before it builds
  the environment, so concurrent resets never pass a limit together.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import ipaddress
import json
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field

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
from flowrl.infra.servers import body_size_refusal

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


@dataclass
class Limits:
    """What one service accepts (see the module docstring)."""

    max_episodes: int = 100_000
    max_episodes_per_owner: int = 10_000
    max_bytes_per_owner: int = 256 * 2**20
    max_body_bytes: int = 2**20
    episode_ttl_s: float = 900.0
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S
    """The longest a reset or step may take, whatever a client asks."""


@dataclass
class _Episode:
    env: Environment | None
    """None while its reset runs (the slot is reserved)."""
    owner: str
    job: str
    nbytes: int
    timeout_s: float
    used: float = field(default_factory=time.monotonic)


INSECURE_OWNER = "local"
"""The one owner of every caller of a service started with ``--insecure-loopback``."""


def create_app(
    max_episodes: int = 100_000,
    serves: list[str] | None = None,
    tokens: dict[str, str] | None = None,
    limits: Limits | None = None,
) -> FastAPI:
    """The service; episodes live in this process's memory until done, deleted or idle past
    the TTL. ``serves``: the environment names it builds (default: every installed one); each
    is loaded now, so a name that does not load stops the service at start, not at a job's
    first episode. ``tokens``: token → owner; None or empty = no authentication (the caller of
    ``main`` allows that only on loopback with ``--insecure-loopback``)."""
    limits = limits or Limits(max_episodes=max_episodes)
    served = sorted(set(serves)) if serves else installed_names()
    for name in served:
        load(name)
    app = FastAPI(title="flowrl environments")
    episodes: dict[tuple[str, str, str], _Episode] = {}
    counters: Counter[str] = Counter()
    held: Counter[str] = Counter()  # bytes of requests held by each owner's live episodes
    live: Counter[str] = Counter()  # each owner's live episodes
    swept = [0.0]
    table = threading.Lock()  # guards episodes, counters, held, live and swept
    by_token = {secrets_key(t): owner for t, owner in (tokens or {}).items()}

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        refusal = body_size_refusal(
            request.method, request.headers.get("content-length"), limits.max_body_bytes
        )
        if refusal is not None:
            return _error(*refusal)
        if request.url.path != "/health":
            owner = _owner(request.headers.get("authorization", ""), by_token)
            if owner is None:
                return _error(401, "missing or unknown bearer token")
            request.state.owner = owner
        _sweep()
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def malformed(request: Request, exc: RequestValidationError) -> Response:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return _error(422, f"malformed request: {where}: {first.get('msg', 'invalid')}"[:300])

    def _sweep() -> None:
        now = time.monotonic()
        with table:
            if now - swept[0] < 1.0:
                return
            swept[0] = now
            for key in [k for k, e in episodes.items() if now - e.used > limits.episode_ttl_s]:
                _drop_locked(key)

    def _drop_locked(key: tuple[str, str, str], only: _Episode | None = None) -> bool:
        """Drop an episode (``only``: if it is still that one); the caller holds ``table``."""
        if only is not None and episodes.get(key) is not only:
            return False
        gone = episodes.pop(key, None)
        if gone is not None:
            held[gone.owner] -= gone.nbytes
            live[gone.owner] -= 1
        return gone is not None

    def _drop(key: tuple[str, str, str], only: _Episode | None = None) -> bool:
        with table:
            return _drop_locked(key, only)

    def episode(owner: str, job: str, episode_id: str) -> _Episode:
        with table:
            found = episodes.get((owner, job, episode_id))
            if found is None or found.env is None:
                raise HTTPException(404, f"no live episode {episode_id!r} of job {job!r}")
            found.used = time.monotonic()
            return found

    def reserve(owner: str, req: ResetRequest, nbytes: int) -> _Episode:
        """Check the limits and take the episode's slot in one step (a reset replaces the
        caller's own episode of that id)."""
        timeout_s = min(req.step_timeout_s or limits.step_timeout_s, limits.step_timeout_s)
        with table:
            _drop_locked((owner, req.job, req.episode_id))
            if len(episodes) >= limits.max_episodes:
                raise HTTPException(503, f"too many live episodes ({limits.max_episodes})")
            if live[owner] >= limits.max_episodes_per_owner:
                raise HTTPException(429, f"at most {limits.max_episodes_per_owner} live episodes")
            if held[owner] + nbytes > limits.max_bytes_per_owner:
                raise HTTPException(
                    429, f"live episodes hold over {limits.max_bytes_per_owner} bytes"
                )
            slot = _Episode(None, owner, req.job, nbytes, timeout_s)
            episodes[(owner, req.job, req.episode_id)] = slot
            held[owner] += nbytes
            live[owner] += 1
            return slot

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/reset")
    def reset(req: ResetRequest, request: Request) -> dict[str, Any]:
        owner: str = request.state.owner
        key = (owner, req.job, req.episode_id)
        slot = reserve(owner, req, int(request.headers["content-length"]))
        try:
            if req.env.name not in served:
                raise HTTPException(
                    403, f"environment {req.env.name!r} is not served here; served: {served}"
                )
            params = json.dumps(req.env.params, sort_keys=True)
            opened = call_with_timeout(
                _open, slot.timeout_s, "reset", req.env.name, params, req.row
            )
        except HTTPException:
            _drop(key, only=slot)
            raise
        except EnvTimeoutError as exc:
            _drop(key, only=slot)
            raise HTTPException(504, str(exc)) from None
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            _drop(key, only=slot)
            raise HTTPException(400, f"reset refused: {str(exc)[:300]}") from None
        except Exception as exc:  # the episode fails, not the service
            _drop(key, only=slot)
            raise HTTPException(500, f"reset failed: {exc!r}"[:300]) from None
        env, answer = opened
        with table:
            if episodes.get(key) is not slot:  # deleted, swept or reset again meanwhile
                raise HTTPException(409, f"episode {req.episode_id!r} was ended during its reset")
            slot.env, slot.used = env, time.monotonic()
        return answer

    @app.post("/step")
    def step(req: StepRequest, request: Request) -> dict[str, Any]:
        owner: str = request.state.owner
        key = (owner, req.job, req.episode_id)
        found = episode(*key)
        try:
            result, images = call_with_timeout(
                _step, found.timeout_s, "step", found.env, req.action
            )
        except EnvTimeoutError as exc:  # the episode is given up; its thread runs on
            _drop(key, only=found)
            raise HTTPException(504, str(exc)) from None
        except Exception as exc:
            _drop(key, only=found)
            raise HTTPException(500, f"step failed: {exc!r}"[:300]) from None
        with table:
            counters[owner] += 1
            if result.done:
                _drop_locked(key, only=found)
        return step_fields(result) | {"images": to_wire(images)}

    @app.delete("/episodes/{job}/{episode_id}")
    def end(job: str, episode_id: str, request: Request) -> dict[str, bool]:
        if not _drop((request.state.owner, job, episode_id)):
            raise HTTPException(404, f"no live episode {episode_id!r} of job {job!r}")
        return {"ended": True}

    @app.get("/stats")
    def stats(request: Request) -> dict[str, Any]:
        owner: str = request.state.owner
        with table:
            jobs = Counter(e.job for e in episodes.values() if e.owner == owner)
            steps = counters[owner]
        return {"episodes": sum(jobs.values()), "jobs": dict(jobs), "steps": steps}

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


def secrets_key(token: str) -> str:
    """What tokens are compared by (a digest: equal-length, constant-time comparison)."""
    return hashlib.sha256(token.encode()).hexdigest()


def _owner(header: str, by_token: dict[str, str]) -> str | None:
    if not by_token:
        return INSECURE_OWNER
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    digest = secrets_key(token.strip())
    for known, owner in by_token.items():
        if hmac.compare_digest(known, digest):
            return owner
    return None


def _error(status: int, detail: str) -> Response:
    return JSONResponse({"detail": detail}, status_code=status)


def read_tokens(path: str | None) -> dict[str, str]:
    """token → owner, from ``path`` (lines ``owner:token``; ``#`` comments) and the
    ``FLOWRL_ENV_SERVICE_TOKENS`` variable (``owner:token,owner:token``)."""
    entries = [e for e in os.environ.get(TOKENS_VAR, "").split(",") if e.strip()]
    if path:
        lines = Path(path).read_text().splitlines()
        entries += [line for line in lines if line.strip() and not line.startswith("#")]
    tokens: dict[str, str] = {}
    for entry in entries:
        owner, sep, token = entry.strip().partition(":")
        if not sep or not owner or len(token) < 16:
            raise SystemExit("a token entry must be owner:token with a token of 16+ characters")
        tokens[token] = owner
    return tokens


TOKENS_VAR = "FLOWRL_ENV_SERVICE_TOKENS"


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="Serve flowrl environments over HTTP.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        help="an environment to serve (entry point name or package.module:Class); repeatable. "
        "Default: every installed environment.",
    )
    parser.add_argument("--tokens-file", help="lines owner:token (or FLOWRL_ENV_SERVICE_TOKENS)")
    parser.add_argument(
        "--insecure-loopback",
        action="store_true",
        help="serve without tokens (every caller one owner); loopback addresses only",
    )
    parser.add_argument("--max-body-bytes", type=int, default=Limits.max_body_bytes)
    parser.add_argument("--max-episodes-per-owner", type=int, default=Limits.max_episodes_per_owner)
    parser.add_argument("--max-bytes-per-owner", type=int, default=Limits.max_bytes_per_owner)
    parser.add_argument("--episode-ttl", type=float, default=Limits.episode_ttl_s)
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=Limits.step_timeout_s,
        help="the longest one reset or step may take (a client may ask for less); 504 after",
    )
    args = parser.parse_args(argv)
    if args.step_timeout <= 0:
        parser.error(f"--step-timeout must be > 0, got {args.step_timeout}")
    tokens = read_tokens(args.tokens_file)
    if not tokens:
        if not args.insecure_loopback:
            parser.error(
                "no tokens: give --tokens-file / FLOWRL_ENV_SERVICE_TOKENS, or "
                "--insecure-loopback on a loopback address"
            )
        if not ipaddress.ip_address(
            args.host if args.host != "localhost" else "127.0.0.1"
        ).is_loopback:
            parser.error(f"--insecure-loopback serves loopback addresses only, not {args.host}")
    limits = Limits(
        max_episodes_per_owner=args.max_episodes_per_owner,
        max_bytes_per_owner=args.max_bytes_per_owner,
        max_body_bytes=args.max_body_bytes,
        episode_ttl_s=args.episode_ttl,
        step_timeout_s=args.step_timeout,
    )
    app = create_app(serves=args.env, tokens=tokens, limits=limits)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level="warning",
        limit_concurrency=512,
        backlog=512,
        timeout_keep_alive=5,
        h11_max_incomplete_event_size=64 * 1024,
    )


if __name__ == "__main__":
    main()
