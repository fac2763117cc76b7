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
the others go on.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any

from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from flowrl.environments.plugin import first_user_message
from flowrl.environments.registry import installed_names, load, make_env
from flowrl.environments.types import (
    Environment,
    from_wire,
    shown_images,
    step_fields,
    to_wire,
)


class EnvSpec(BaseModel):
    name: str = Field(description="Registered environment name.")
    params: dict[str, Any] = Field(default_factory=dict, description="Its task parameters.")


class ResetRequest(BaseModel):
    job: str
    episode_id: str
    env: EnvSpec
    row: dict[str, Any] = Field(default_factory=dict)


class StepRequest(BaseModel):
    job: str
    episode_id: str
    action: str


def create_app(max_episodes: int = 100_000, serves: list[str] | None = None) -> FastAPI:
    """The service; episodes live in this process's memory until done or deleted. ``serves``:
    the environment names it builds (default: every installed one); each is loaded now, so a
    name that does not load stops the service at start, not at a job's first episode."""
    served = sorted(set(serves)) if serves else installed_names()
    for name in served:
        load(name)
    app = FastAPI(title="flowrl environments")
    episodes: dict[tuple[str, str], Environment] = {}
    counters: Counter[str] = Counter()

    def episode(job: str, episode_id: str) -> Environment:
        try:
            return episodes[(job, episode_id)]
        except KeyError:
            raise HTTPException(404, f"no live episode {episode_id!r} of job {job!r}") from None

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/reset")
    def reset(req: ResetRequest) -> dict[str, Any]:
        if len(episodes) >= max_episodes:
            raise HTTPException(503, f"too many live episodes ({max_episodes})")
        if req.env.name not in served:
            raise HTTPException(
                403, f"environment {req.env.name!r} is not served here; served: {served}"
            )
        try:
            env = make_env(req.env.name, req.env.params)
            observation = first_user_message(env, env.reset(**from_wire(req.row)))
            images = shown_images(env)
        except (ValueError, TypeError) as exc:  # the row or params are wrong: the caller's error
            raise HTTPException(400, f"reset refused: {exc}") from None
        except Exception as exc:  # the episode fails, not the service
            raise HTTPException(500, f"reset failed: {exc!r}") from exc
        episodes[(req.job, req.episode_id)] = env
        return {
            "observation": observation,
            "system_prompt": env.get_system_prompt(),
            "images": to_wire(images),
        }

    @app.post("/step")
    def step(req: StepRequest) -> dict[str, Any]:
        env = episode(req.job, req.episode_id)
        try:
            result = env.step(req.action)
            images = [] if result.done else shown_images(env)
        except Exception as exc:
            episodes.pop((req.job, req.episode_id), None)
            raise HTTPException(500, f"step failed: {exc!r}") from exc
        counters["steps"] += 1
        if result.done:
            episodes.pop((req.job, req.episode_id), None)
        return step_fields(result) | {"images": to_wire(images)}

    @app.delete("/episodes/{job}/{episode_id}")
    def end(job: str, episode_id: str) -> dict[str, bool]:
        return {"ended": episodes.pop((job, episode_id), None) is not None}

    @app.get("/stats")
    def stats() -> dict[str, Any]:
        jobs = Counter(job for job, _ in episodes)
        return {"episodes": len(episodes), "jobs": dict(jobs), "steps": counters["steps"]}

    return app


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
    args = parser.parse_args(argv)
    app = create_app(serves=args.env)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
