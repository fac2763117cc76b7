"""Rollout sessions: an agent's OpenAI client bound to one rollout, every request recorded as
the tokens it was sampled as (``agent_loop.recorded.Turn``).

A session is opened per episode (``SessionTable.open``) with a key of its own; its base URL is
``/sessions/<id>/v1`` and its key is accepted there only, until the episode ends (``close``):
one rollout cannot read or write another's session, and a closed session answers 404.

Token-exact multi-turn: when a request's messages are the previous request's messages, then
the answer the endpoint gave (its content and its tool calls, ids and ``arguments`` strings
unchanged; a null content echoed as null or ``""``), then new user or tool messages, and its
tool definitions are the previous request's, its prompt is built from tokens, not re-rendered
text: the previous prompt + the sampled completion (+ the end-of-turn token when the
completion had none) + the new messages' rendering (``HFChatFormat.encode_turns``: several
tool results together, as the template groups them). Any other request (the agent rewrote its
history, or changed its tools) is rendered from its messages, and ``trajectories_from_turns``
starts a new trajectory there.

Tools (``tools.py``): a session request may carry ``tools`` when the policy's chat family can
express them; the answer's tool calls come back as ``tool_calls``.

Requests of all sessions are sampled in batches (``Batcher``), each cut to its own
``max_tokens``. By default what arrives within a few milliseconds of the first pending request
goes to the sampler in one call (by temperature). In lockstep (a rollout's sessions,
``tasks.agent_episodes``) a call waits until every open session has a request pending (or
none has come for a while: ``LOCKSTEP_WAIT_S``) and takes them in the order the sessions were
opened: which requests share a call, and their order, no longer depend on when they arrive, so
a seeded sampler samples the same tokens however the machine schedules the agents.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fastapi import Request

from flowrl.agent_loop.recorded import Turn
from flowrl.agent_loop.types import SampleResult
from flowrl.backends.services.openai_api.tools import (
    ToolRequest,
    answer_message,
    echoed,
    for_template,
)
from flowrl.infra.serving import ServiceError

if TYPE_CHECKING:
    from flowrl.backends.models.chat import HFChatFormat

log = logging.getLogger(__name__)
SampleFn = Callable[[list[list[int]], int, float, int], list[SampleResult]]
"""``(prompts, max_new_tokens, temperature, seed) -> results``: the policy's sampler."""


LOCKSTEP_WAIT_S = 2.0
"""How long (at most: ``Batcher``'s ``lockstep_wait_s``) a lockstep call waits, with no request
arriving and no session joining or leaving, for the open sessions that have no request pending
(agents working between turns, or hung): then it samples the requests that are there."""


SESSION_THREADS = 4096
"""Requests of a rollout's sessions answered at once (each waits for its batch in a thread)."""


@dataclass
class _Pending:
    prompt: list[int]
    max_tokens: int
    temperature: float
    order: int
    done: threading.Event = field(default_factory=threading.Event)
    result: SampleResult | None = None
    error: BaseException | None = None


class Batcher:
    """Requests from many sessions sampled together: a call takes every request pending
    ``window_s`` after the first, of the first's temperature; with ``lockstep``, every request
    pending once each session that joined and has not left (``join``, ``leave``) has one, or
    once nothing has changed for ``lockstep_wait_s``, in the order of ``sample``'s ``order``."""

    def __init__(
        self,
        sample: SampleFn,
        seed: int,
        window_s: float = 0.02,
        lockstep: bool = False,
        lockstep_wait_s: float = LOCKSTEP_WAIT_S,
    ):
        self._sample = sample
        self._seed = seed
        self._window_s = window_s
        self._lockstep = lockstep
        self._lockstep_wait_s = lockstep_wait_s
        self._members = 0
        self._changed = time.monotonic()  # the last request's arrival, or a member's join or leave
        self._calls = 0
        self._pending: list[_Pending] = []
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="session-batcher")
        self._thread.start()

    def join(self) -> None:
        """A session joins the lockstep: calls wait for its requests until it leaves."""
        self._count_members(+1)

    def leave(self) -> None:
        self._count_members(-1)

    def _count_members(self, change: int) -> None:
        with self._cond:
            self._members += change
            self._changed = time.monotonic()
            self._cond.notify()

    def sample(
        self, prompt: list[int], max_tokens: int, temperature: float, order: int = 0
    ) -> SampleResult:
        item = _Pending(prompt, max_tokens, temperature, order)
        with self._cond:
            if self._stop:
                raise ServiceError(503, "the rollout's sampler is closed")
            self._pending.append(item)
            self._changed = time.monotonic()
            self._cond.notify()
        item.done.wait()
        if item.error is not None:
            raise item.error
        assert item.result is not None
        return item.result

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(10)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._pending and not self._stop:
                    self._cond.wait()
                if self._stop and not self._pending:
                    return
            if self._lockstep:
                self._wait_for_members()
            else:
                time.sleep(self._window_s)
            with self._cond:
                self._pending.sort(key=lambda p: p.order)
                temperature = self._pending[0].temperature
                batch = [p for p in self._pending if p.temperature == temperature]
                self._pending = [p for p in self._pending if p.temperature != temperature]
            self._serve(batch, temperature)

    def _wait_for_members(self) -> None:
        with self._cond:
            while len(self._pending) < self._members and not self._stop:
                left = self._changed + self._lockstep_wait_s - time.monotonic()
                if left <= 0:
                    log.info(
                        "lockstep: %d of %d sessions' requests sampled without the others' "
                        "(none came for %.1f s)",
                        len(self._pending),
                        self._members,
                        self._lockstep_wait_s,
                    )
                    return
                self._cond.wait(left)

    def _serve(self, batch: list[_Pending], temperature: float) -> None:
        self._calls += 1
        try:
            longest = max(p.max_tokens for p in batch)
            seed = (self._seed * 1_000_003 + self._calls) % 2**62
            results = self._sample([p.prompt for p in batch], longest, temperature, seed)
            for item, result in zip(batch, results, strict=True):
                item.result = _cut(result, item.max_tokens)
        except BaseException as err:  # noqa: BLE001 - every waiting request gets the error
            for item in batch:
                item.error = err
        finally:
            for item in batch:
                item.done.set()


def _cut(result: SampleResult, max_tokens: int) -> SampleResult:
    if len(result.tokens) <= max_tokens:
        return result
    return SampleResult(result.tokens[:max_tokens], result.logprobs[:max_tokens], "length")


class ContextFull(ServiceError):
    """A session's conversation leaves no room to answer in the context (400)."""


@dataclass
class Session:
    """One episode's session: its key, its recorded turns, and what the last request and its
    answer were (the answer as the agent's echo of it reads: ``tools.echoed``)."""

    session_id: str
    key: str
    turns: list[Turn] = field(default_factory=list)
    last_messages: list[dict[str, Any]] = field(default_factory=list)
    last_answer: dict[str, Any] | None = None
    last_tools: list[dict[str, Any]] = field(default_factory=list)
    closed: bool = False
    order: int = 0


class SessionTable:
    """The open rollout sessions of one process, sampling through one ``Batcher``; ``chat``
    is the policy's chat format (its template renders the tools and the new messages)."""

    def __init__(self, chat: HFChatFormat, batcher: Batcher, context_length: int, max_tokens: int):
        self.chat = chat
        self.batcher = batcher
        self.context_length = context_length
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._opened = 0

    def open(self) -> Session:
        """A new session, a member of the batcher's lockstep until it is closed."""
        with self._lock:
            key = "rollout-" + secrets.token_urlsafe(24)
            session = Session(secrets.token_hex(8), key, order=self._opened)
            self._opened += 1
            self._sessions[session.session_id] = session
        self.batcher.join()
        return session

    def close(self, session: Session) -> list[Turn]:
        """End the session (its key no longer answers); its recorded turns."""
        with self._lock:
            was_open = self._sessions.pop(session.session_id, None) is not None
        if was_open:
            self.batcher.leave()
        session.closed = True
        return list(session.turns)

    def session(self, session_id: str, key: str | None) -> Session:
        """The open session ``session_id`` if ``key`` is its own; else 404 (no hint whether
        the id exists)."""
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None or key is None or not secrets.compare_digest(session.key, key):
            raise ServiceError(404, f"no session {session_id[:40]!r}")
        return session

    def prompt(
        self,
        session: Session,
        messages: list[dict[str, Any]],
        tools: ToolRequest | None = None,
    ) -> list[int]:
        """The request's prompt: from the previous turn's tokens when the messages continue
        it (with the same tool definitions), else rendered from the messages."""
        tools = tools or ToolRequest()
        last = session.turns[-1] if session.turns else None
        k = len(session.last_messages)
        new = messages[k + 1 :]
        continues = (
            last is not None
            and len(messages) > k + 1
            and messages[:k] == session.last_messages
            and messages[k] == session.last_answer
            and tools.definitions == session.last_tools
            and all(m.get("role") in ("user", "tool") for m in new)
        )
        if not continues:
            return self.chat.encode_prompt(for_template(messages), tools.template_tools)
        assert last is not None
        tokens = last.prompt + last.completion + self.chat.closing(list(last.completion))
        return tokens + self.chat.encode_turns(new, tools.template_tools)

    def complete(
        self,
        session: Session,
        messages: list[dict[str, Any]],
        max_tokens: int | None,
        temperature: float,
        tools: ToolRequest | None = None,
    ) -> tuple[list[int], SampleResult, dict[str, Any]]:
        """Sample the session's next turn; (prompt, result, the answer message: content and
        tool calls) — recorded."""
        from jinja2 import TemplateError

        tools = tools or ToolRequest()
        try:
            prompt = self.prompt(session, messages, tools)
        except (TemplateError, ValueError) as err:  # the template refuses these messages
            raise ServiceError(400, f"messages: {err}"[:300]) from None
        room = self.context_length - len(prompt)
        if room < 1:
            raise ContextFull(
                400,
                f"messages: the conversation ({len(prompt)} tokens) fills the context of "
                f"{self.context_length}",
            )
        budget = min(room, self.max_tokens, max_tokens or self.max_tokens)
        result = self.batcher.sample(prompt, budget, temperature, session.order)
        stopped = result.finish_reason == "stop"
        body = result.tokens[:-1] if stopped else result.tokens
        answer = answer_message(self.chat, self.chat.decode(list(body)), tools)
        session.turns.append(
            Turn(
                prompt,
                list(result.tokens),
                list(result.logprobs),
                result.finish_reason,
                [*messages, answer],
            )
        )
        session.last_messages, session.last_answer = list(messages), echoed(answer)
        session.last_tools = tools.definitions
        return prompt, result, answer


def create_session_app(table: SessionTable, temperature: float) -> Any:
    """The rollout sessions' endpoint: ``POST /sessions/<id>/v1/chat/completions`` with the
    session's key (``Authorization: Bearer``). Requests sample at the rollout's
    ``temperature`` (the one the trainer scores them at): a request asking another gets a 400
    naming it. The answer is a chat completion with the sampled ``token_ids``."""
    import anyio.to_thread

    from flowrl.backends.services.openai_api.routes import (
        chat_answer,
        json_object,
        request_messages,
    )
    from flowrl.backends.services.openai_api.service import Completion, check_parameters
    from flowrl.backends.services.openai_api.tools import check_expressible, tool_request
    from flowrl.infra.serving import Keys, ServingLimits, guarded_app, presented_key

    app = guarded_app("flowrl rollout sessions", Keys(None), ServingLimits())
    # A request's thread waits for its batch: every open session must be able to wait at once
    # (anyio's default pool of 40 would cap a batch at 40 requests).
    threads = anyio.CapacityLimiter(SESSION_THREADS)

    @app.post("/sessions/{session_id}/v1/chat/completions", response_model=None)
    async def chat(session_id: str, request: Request) -> Any:
        session = table.session(session_id, presented_key(request.headers))
        body = await json_object(request)
        check_parameters(body)
        if body.get("n") not in (None, 1) or body.get("n") is True:
            raise ServiceError(400, "n: not supported in a rollout session")
        if body.get("stream") not in (None, False):
            raise ServiceError(400, "stream: not supported in a rollout session")
        tools = tool_request(body)
        asked = body.get("temperature")
        if asked is not None and asked != temperature:
            raise ServiceError(
                400,
                f"temperature: a rollout samples at the job's {temperature:g} "
                f"(rollout.temperature), got {asked!r}; leave it unset",
            )
        messages = request_messages(body.get("messages"))
        check_expressible(table.chat, tools, messages)
        asked_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if asked_tokens is not None and (
            not isinstance(asked_tokens, int) or isinstance(asked_tokens, bool) or asked_tokens < 1
        ):
            raise ServiceError(400, f"max_tokens: a positive integer, got {str(asked_tokens)[:40]}")
        prompt, result, answer = await anyio.to_thread.run_sync(
            table.complete, session, messages, asked_tokens, temperature, tools, limiter=threads
        )
        finish = "stop" if result.finish_reason == "stop" else "length"
        text = answer["content"] or ""
        completion = Completion(list(result.tokens), list(result.logprobs), finish, text)
        view = _View(table.chat, "policy")
        return chat_answer(view, prompt, [completion], [answer], bool(body.get("logprobs")))

    return app


@dataclass
class _View:
    """What ``routes.chat_answer`` reads of a model: its chat format, name and fingerprint."""

    chat: Any
    name: str
    fingerprint: str | None = None
