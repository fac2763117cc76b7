"""The Tinker API's session search (``RestClient.search_sessions``): a key's sessions, newest
first, filtered as the SDK's ``SessionSearchRequest`` asks, a page at a time.

A key is one owner (``urn:flowrl:namespace:<namespace>``) and sees only its own sessions, so
``own`` and ``accessible`` search the same ones, and a ``user`` search finds them only when it
names the caller. A session without a project is in project ``default``. Sessions are those of
this service's life and of its journal: one that ended before a restart is not found."""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime
from typing import Any

from flowrl.backends.services.tinker.checkpoints import Checkpoints
from flowrl.backends.services.tinker.state import Session
from flowrl.infra.serving import ServiceError

DEFAULT_PROJECT = "default"


def owner_urn(namespace: str | None) -> str:
    return f"urn:flowrl:namespace:{namespace or 'loopback'}"


def search_sessions(
    sessions: list[Session], checkpoints: Checkpoints, namespace: str | None, req: Any
) -> dict[str, Any]:
    """One page of ``sessions`` (all of the service's) that the caller in ``namespace`` owns
    and ``req`` (a parsed ``SessionSearchRequest``) matches."""
    owner = req.owner
    if owner.type == "user" and owner_urn(namespace) not in owner.owner_urns:
        return {"sessions": [], "next_cursor": None}
    found = [s for s in sessions if s.namespace == namespace and _matches(s, req)]
    found.sort(key=lambda s: (s.created_at, s.session_id), reverse=True)
    if req.cursor is not None:
        after = (req.cursor.last_created_at.timestamp(), req.cursor.last_session_id)
        found = [s for s in found if (s.created_at, s.session_id) < after]
    page, more = found[: req.limit], len(found) > req.limit
    cursor = None
    if more:
        last = page[-1]
        cursor = {"last_created_at": _iso(last.created_at), "last_session_id": last.session_id}
    summaries = [_summary(s, checkpoints, namespace) for s in page]
    return {"sessions": summaries, "next_cursor": cursor}


def _matches(s: Session, req: Any) -> bool:
    if req.session_id is not None or req.display_name is not None:
        by_id = req.session_id is not None and s.session_id == req.session_id
        words = (req.display_name or "").lower().split()
        name = (s.display_name or "").lower()
        by_name = req.display_name is not None and all(w in name for w in words)
        if not (by_id or by_name):
            return False
    if req.project_ids is not None and (s.project_id or DEFAULT_PROJECT) not in req.project_ids:
        return False
    if any(s.user_metadata.get(k) != v for k, v in req.user_metadata.items()):
        return False
    return req.statuses is None or any(_status_matches(s, q) for q in req.statuses)


def _status_matches(s: Session, query: Any) -> bool:
    if query.type == "active":
        return not s.ended
    status = s.status or {}
    if status.get("type") != query.type:
        return False
    if query.type == "client_finished" and query.reasons is not None:
        return status["reason"]["type"] in query.reasons
    return True


def finish_status(body: Any) -> dict[str, Any]:
    """A client's ``sessions/{id}/finish`` body as the session's ``SessionStatus``; a reason
    the SDK does not define is a 400."""
    body = body if isinstance(body, dict) else {}
    reason = body.get("reason") or {"type": "success"}
    kind = reason.get("type") if isinstance(reason, dict) else None
    if kind not in ("success", "errored", "interrupted"):
        raise ServiceError(400, "reason.type must be success, errored or interrupted")
    detail = body.get("detail")
    if detail is not None and not isinstance(detail, str):
        raise ServiceError(400, "detail must be a string")
    return {"type": "client_finished", "reason": {"type": kind}, "detail": detail}


def _summary(s: Session, checkpoints: Checkpoints, namespace: str | None) -> dict[str, Any]:
    count = 0
    for run_id in s.models:
        with contextlib.suppress(ServiceError):  # a run that saved nothing yet
            count += len(checkpoints.of_run(namespace, run_id))
    return {
        "session_id": s.session_id,
        "created_at": _iso(s.created_at),
        "owner": owner_urn(namespace),
        "project_id": s.project_id or DEFAULT_PROJECT,
        "status": {"type": "active"} if not s.ended else s.status,
        "checkpoints_count": count,
        "display_name": s.display_name,
        "user_metadata": s.user_metadata or None,
        "checkpoint_storage_bytes": None,
    }


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat()
