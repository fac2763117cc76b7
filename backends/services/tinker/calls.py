"""The Tinker service's calls: each verb's future, the journal a restarted service carries on
from (``journal.py``), and the answers a client's retry of the same request gets again."""

from __future__ import annotations

import base64
import concurrent.futures
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from flowrl.backends.models.tinker_checkpoints import not_found
from flowrl.backends.services.tinker.journal import Journal
from flowrl.backends.services.tinker.state import Future

HISTORY_VERBS = ("forward_backward", "optim_step")
"""The verbs whose calls can be part of a model's history (``journal.py``)."""


class Calls:
    """Futures by id (each its namespace's), the journal (None: nothing outlives the process)
    and the answers kept for retries. ``lock`` is the service's."""

    def __init__(self, lock: threading.RLock, journal: Journal | None = None):
        self.lock = lock
        self.journal = journal
        self.futures: dict[str, Future] = {}
        self.try_again = 0  # 408 answers to retrieve_future (a result not ready in a long poll)
        self.answered: dict[tuple, dict] = {}  # (target, verb, seq_id) -> its answer
        self._answer_keys: dict[str, tuple] = {}  # future id -> its key in ``answered``
        self.body_bytes: dict[str, int] = {}  # future id -> its journaled request's size
        self.replaying = threading.local()
        """``replay``: the future id of the journal's call being replayed; ``request_id``: the
        id the next verb's future takes."""

    def submit(
        self,
        namespace: str | None,
        kind: str,
        worker: Any,
        fn: Callable[[], Any],
        request_id: str | None = None,
    ) -> str:
        request_id = request_id or self.next_request_id()
        future = worker.submit(fn)
        with self.lock:
            self.futures[request_id] = Future(namespace, kind, future)
        return request_id

    def answered_now(self, namespace: str | None, result: dict) -> str:
        """The id of a future whose ``result`` is already had."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result(result)
        request_id = secrets.token_hex(12)
        with self.lock:
            self.futures[request_id] = Future(namespace, str(result.get("type", "")), done)
        return request_id

    def next_request_id(self) -> str:
        """The id of the verb's future: the journal's (``journaled``), else a new one."""
        preset = getattr(self.replaying, "request_id", None)
        self.replaying.request_id = None
        return preset or secrets.token_hex(12)

    def journaled(
        self,
        namespace: str | None,
        verb: str,
        target: str,
        seq_id: int | None,
        raw: bytes,
        answer: Callable[[], dict],
    ) -> dict:
        """``answer()`` (a verb's future), written to the journal first; a client's retry of
        a request already answered (the same ``seq_id`` of the same target and verb) gets the
        same future, and nothing runs again."""
        key = (target, verb, seq_id) if seq_id is not None else None
        with self.lock:
            if key is not None and key in self.answered:
                return self.answered[key]
        if self.journal is None:
            return answer()
        request_id = getattr(self.replaying, "replay", None)
        if request_id is None:
            request_id = secrets.token_hex(12)
            self.journal.write(
                {
                    "op": "call",
                    "rid": request_id,
                    "verb": verb,
                    "ns": namespace,
                    "target": target,
                    "body": base64.b64encode(raw).decode(),
                }
            )
        if verb in HISTORY_VERBS:
            with self.lock:
                self.body_bytes[request_id] = len(raw)
        self.replaying.request_id = request_id
        try:
            response = answer()
        except BaseException:
            self.done(request_id)  # refused at once: there is nothing to answer again
            with self.lock:
                self.body_bytes.pop(request_id, None)
            raise
        finally:
            self.replaying.request_id = None
        if key is not None:
            with self.lock:
                self.answered[key] = response
                self._answer_keys[request_id] = key
        return response

    def done(self, request_id: str) -> None:
        """The client has the result of ``request_id``: it need not be answered again."""
        with self.lock:
            key = self._answer_keys.pop(request_id, None)
            if key is not None:
                self.answered.pop(key, None)
        if self.journal is not None:
            self.journal.write({"op": "done", "rid": request_id})

    def note(self, entry: dict) -> None:
        """A change of the service's state, for a restarted service (with a journal)."""
        if self.journal is not None:
            self.journal.write(entry)

    def future(self, namespace: str | None, request_id: str) -> Future:
        with self.lock:
            entry = self.futures.get(request_id) if isinstance(request_id, str) else None
        if entry is None or entry.namespace != namespace:
            raise not_found(f"no future {str(request_id)[:80]!r}")
        return entry

    def expire(self, ttl_s: float) -> None:
        """Forget the futures done more than ``ttl_s`` ago."""
        now = time.monotonic()
        with self.lock:
            old = [
                k for k, f in self.futures.items() if f.future.done() and now - f.created > ttl_s
            ]
            for k in old:
                del self.futures[k]
