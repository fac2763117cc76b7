"""Episodes played by the user's agent (``environments.agent``) through rollout sessions.

``run_agent_episodes`` is the agent counterpart of ``loop.run_episodes``: for one batch of
episodes it serves a rollout-session endpoint on loopback
(``backends.services.openai_api.sessions``, every request sampled by the job's sampler in batches
and recorded as tokens), opens a session per episode, calls the agent with it, scores what the agent
returns, closes the session (its key stops answering) and builds the episode's trajectories from the
recorded turns (``recorded.trajectories_from_turns``).

The rollout's budgets (``LoopLimits``) hold per session: ``max_turns`` requests,
``max_new_tokens`` per answer, ``max_context_tokens`` for prompt + answer, and the rollout's
temperature. A request beyond ``max_turns``, or whose conversation fills the context, answers
400; an agent that then gives up (raises) ends its episode as ``max_turns`` or ``max_tokens``
with reward 0 — what the agent loop does with such an episode, a lesson rather than a failure.

Failures fail the episode alone (``StopReason.ERROR``, ``info["error"]``; the update leaves it
out and ``rollout/failed_episodes`` counts it): an exception from the agent, the task's
environment or the scoring, and an episode over the task's ``timeout_s``. Episodes run side by
side, so k hung agents cost one timeout, not k. An agent that blocks the event loop itself
(a plain blocking call inside ``async def``) stops every episode of the batch: they all fail
once the timeout and a margin have passed, and the loop's thread is abandoned.

The sessions sample in lockstep (``sessions.Batcher``): a sampler call waits until every open
session has its request pending and takes them in episode order, so under a fixed seed the
episodes sample the same tokens however the agents' threads are scheduled, as the agent loop's
do. What breaks that: a pause of over ``sessions.LOCKSTEP_WAIT_S`` (a quarter of the task's
``timeout_s`` if less) in which no agent sends a request: the requests that are there are then
sampled without the missing ones, so a hung agent costs the others that pause once per turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from typing import Any

from flowrl.agent_loop.loop import LoopLimits
from flowrl.agent_loop.recorded import trajectories_from_turns
from flowrl.agent_loop.types import ChatFormat, Sampler, StopReason, Trajectory
from flowrl.backends.services.openai_api.sessions import (
    LOCKSTEP_WAIT_S,
    Batcher,
    ContextFull,
    Session,
    SessionTable,
    create_session_app,
)
from flowrl.environments.agent import AgentRollout, AgentTask
from flowrl.environments.plugin import first_user_message
from flowrl.environments.timeouts import calls_abandoned
from flowrl.infra.serving import BackgroundServer, ServiceError

log = logging.getLogger(__name__)
STUCK_MARGIN_S = 30.0
"""How long past the task's ``timeout_s`` a batch waits for an event loop an agent blocked."""
BLOCKED = "the agent blocked the rollout's event loop (a blocking call in async def?)"
STOPPING = "the job is stopping"


def run_agent_episodes(
    task: AgentTask,
    rows: list[dict[str, Any]],
    group_ids: list[int],
    sampler: Sampler,
    chat: ChatFormat,
    limits: LoopLimits,
    episode_ids: list[str],
) -> list[Trajectory]:
    """One batch of agent episodes, ``rows[i]`` as episode ``episode_ids[i]`` of group
    ``group_ids[i]``; their trajectories in episode order (more than one for an episode whose
    agent rewrote its history)."""
    batcher = Batcher(
        lambda prompts, n, temperature, _: sampler.sample(prompts, n, temperature),
        0,
        lockstep=True,
        lockstep_wait_s=min(LOCKSTEP_WAIT_S, task.timeout_s / 4),  # a hung agent's cost
    )
    table = _BudgetedTable(
        chat, batcher, limits.max_context_tokens, limits.max_new_tokens, limits.max_turns
    )
    server = BackgroundServer(create_session_app(table, limits.temperature))
    try:
        batch = _Batch(task, rows, group_ids, episode_ids, table, server.url)
        return [t for outcome in batch.play() for t in outcome]
    finally:
        server.stop()
        batcher.close()


class _BudgetedTable(SessionTable):
    """Sessions that answer at most ``max_requests`` requests each (then 400); ``ended`` says
    which sessions were refused for a budget, and which."""

    def __init__(
        self,
        chat: ChatFormat,
        batcher: Batcher,
        context_length: int,
        max_tokens: int,
        max_requests: int,
    ):
        super().__init__(chat, batcher, context_length, max_tokens)
        self.max_requests = max_requests
        self.ended: dict[str, tuple[StopReason, str]] = {}

    def complete(self, session: Session, *args: Any, **kwargs: Any) -> Any:
        if len(session.turns) >= self.max_requests:
            why = f"this rollout's {self.max_requests} requests are used up (rollout.max_turns)"
            self.ended[session.session_id] = (StopReason.MAX_TURNS, why)
            raise ServiceError(400, why)
        try:
            return super().complete(session, *args, **kwargs)
        except ContextFull as full:
            self.ended[session.session_id] = (StopReason.MAX_TOKENS, str(full))
            raise


class _Batch:
    """The episodes of one call, played on an event loop in a thread of their own."""

    def __init__(
        self,
        task: AgentTask,
        rows: list[dict[str, Any]],
        group_ids: list[int],
        episode_ids: list[str],
        table: _BudgetedTable,
        url: str,
    ):
        self.task, self.rows, self.group_ids, self.ids = task, rows, group_ids, episode_ids
        self.table, self.url = table, url
        self.outcomes: list[list[Trajectory] | None] = [None] * len(rows)
        self.sessions: list[Session | None] = [None] * len(rows)
        self.done = threading.Event()

    def play(self) -> list[list[Trajectory]]:
        """Every episode's trajectories; returns early, failing what is unfinished, when the
        job stops (``environments.timeouts.abandoning_calls``) or an agent blocked the loop."""
        threading.Thread(target=self._run, daemon=True, name="agent-episodes").start()
        deadline = time.monotonic() + self.task.timeout_s + STUCK_MARGIN_S
        while not self.done.wait(0.25):
            if calls_abandoned() or time.monotonic() > deadline:
                break
        for i, outcome in enumerate(self.outcomes):
            if outcome is None:  # the event loop never came back to this episode
                self.outcomes[i] = self._failed(i, STOPPING if calls_abandoned() else BLOCKED)
        failed = [o[0].info["error"] for o in self.outcomes if o and o[0].failed]
        if failed:
            log.warning(
                "%d of %d agent episodes failed; the first: %s",
                len(failed),
                len(self.rows),
                failed[0],
            )
        return [outcome or [] for outcome in self.outcomes]

    def _run(self) -> None:
        try:
            asyncio.run(self._all())
        finally:
            self.done.set()

    async def _all(self) -> None:
        await asyncio.gather(*(self._episode(i) for i in range(len(self.rows))))
        self.done.set()  # before asyncio.run's own clean-up

    async def _episode(self, i: int) -> None:
        session = self.table.open()
        self.sessions[i] = session
        try:
            reward, info = await asyncio.wait_for(self._play(i, session), self.task.timeout_s)
            stop = StopReason.DONE
        except TimeoutError:
            self.outcomes[i] = self._failed(
                i, f"the episode took over env.params.timeout_s = {self.task.timeout_s:g} s"
            )
            return
        except Exception as err:  # noqa: BLE001 - the agent's or the task's: this episode fails
            if session.session_id not in self.table.ended:
                self.outcomes[i] = self._failed(i, f"{type(err).__name__}: {err}")
                return
            stop, why = self.table.ended[session.session_id]
            reward, info = 0.0, {"refused": why[:300]}
        turns = self.table.close(session)
        info = info | {"requests": len(turns)}
        self.outcomes[i] = trajectories_from_turns(
            turns, self.ids[i], self.group_ids[i], reward, stop, info
        )

    async def _play(self, i: int, session: Session) -> tuple[float, dict[str, Any]]:
        """Open the task on row i, run the agent on the session, score its result."""
        row = self.rows[i]
        env, system_prompt, opening = await _in_thread(_open, self.task, row)
        rollout = AgentRollout(
            base_url=f"{self.url}/sessions/{session.session_id}/v1",
            api_key=session.key,
            row=dict(row),
            system_prompt=system_prompt,
            prompt=opening,
            episode_id=self.ids[i],
        )
        agent = type(self.task).agent
        if inspect.iscoroutinefunction(agent):
            result = await agent(rollout)
        else:
            result = await _in_thread(agent, rollout)
            if inspect.isawaitable(result):
                result = await result
        return await _in_thread(self.task.score, env, row, result)

    def _failed(self, i: int, why: str) -> list[Trajectory]:
        session = self.sessions[i]
        turns = self.table.close(session) if session is not None else []
        info = {"error": why[:300], "requests": len(turns)}
        return trajectories_from_turns(
            turns, self.ids[i], self.group_ids[i], 0.0, StopReason.ERROR, info
        )


def _open(task: AgentTask, row: dict[str, Any]) -> tuple[Any, str, str]:
    """The episode's environment reset on ``row``: (env, system prompt, first user message)."""
    env = task.make_env()
    opening = first_user_message(env, env.reset(**row))
    return env, env.get_system_prompt() or "", opening


async def _in_thread(function: Any, *args: Any) -> Any:
    """``function(*args)`` in a daemon thread of its own: a call that never returns is left to
    the process's exit instead of holding a pool (or the interpreter's exit) hostage."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[Any] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():  # cancelled meanwhile (the episode's timeout)
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def work() -> None:
        try:
            result, error = function(*args), None
        except Exception as err:  # noqa: BLE001 - handed to the awaiting episode
            result, error = None, err
        with contextlib.suppress(RuntimeError):  # the batch's loop is gone: nobody waits
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=work, daemon=True, name="agent-call").start()
    return await future
