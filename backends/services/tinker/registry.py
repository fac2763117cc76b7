"""The Tinker service's sessions and training models: a session's heartbeats and end, each
model's start on its placement and its worker thread, which runs the model's calls in arrival
order (``run_on``), and the per-key limit on live models."""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from flowrl.backends.engines.tinker.types import tinker_lora_config, training_lora
from flowrl.backends.models.tinker_checkpoints import RUN_PATTERN, not_found, run_folder
from flowrl.backends.policy.placement import Placement
from flowrl.backends.policy.tinker_handles import Answered, ModelHandle, actor_lost, work_for
from flowrl.backends.services.tinker.calls import Calls
from flowrl.backends.services.tinker.state import Limits, Model, Session, now
from flowrl.backends.types import LoraSettings
from flowrl.infra.serving import ServiceError
from flowrl.infra.storage import Storage


class Registry:
    """Sessions and training models by id, each its namespace's (404 to another). Training
    models start on ``placement``; base models are the ``catalogue``'s."""

    def __init__(
        self,
        placement: Placement,
        catalogue: dict[str, str],
        limits: Limits,
        storage: Storage,
        calls: Calls,
    ):
        self.placement = placement
        self.catalogue = catalogue
        self.limits = limits
        self.storage = storage
        self.calls = calls
        self.lock: threading.RLock = calls.lock
        self.sessions: dict[str, Session] = {}
        self.models: dict[str, Model] = {}
        self.restore: Callable[[Model, str], None] | None = None
        """Makes a model whose weights were lost again (``Training.restore``; with a journal)."""
        self.bound_history: Callable[[Model], None] | None = None
        """Saves a model's state when its history grows too long (``Training``)."""

    def base_uri(self, name: str) -> str:
        if name not in self.catalogue:
            raise ServiceError(
                400,
                f"unknown base model {name[:120]!r} (this server has: {sorted(self.catalogue)})",
            )
        return self.catalogue[name]

    # ------------------------------------------------------------------- sessions

    def create_session(self, namespace: str | None, body: dict) -> str:
        session_id = secrets.token_hex(8)
        meta = body.get("user_metadata") or {}
        if not isinstance(meta, dict):
            raise ServiceError(400, "user_metadata must be an object")
        project = body.get("project_id")
        if project is not None and (not isinstance(project, str) or not 0 < len(project) <= 200):
            raise ServiceError(400, "project_id must be a string of 1 to 200 characters")
        tags = body.get("tags") or []
        if not isinstance(tags, list) or len(tags) > 64:
            raise ServiceError(400, "tags must be a list of at most 64 strings")
        s = Session(
            session_id,
            namespace,
            body.get("display_name"),
            {str(k): str(v) for k, v in meta.items()},
            tags=sorted({str(t)[:200] for t in tags}),
            project_id=project,
        )
        with self.lock:
            self.sessions[session_id] = s
        entry = {"op": "session", "session_id": session_id, "ns": namespace}
        entry |= {"display_name": s.display_name, "meta": s.user_metadata}
        self.calls.note(entry | {"tags": s.tags, "project_id": project, "created_at": s.created_at})
        return session_id

    def session(self, namespace: str | None, session_id: Any, live: bool = True) -> Session:
        with self.lock:
            s = self.sessions.get(session_id) if isinstance(session_id, str) else None
        if s is None or s.namespace != namespace:
            raise not_found(f"no session {str(session_id)[:80]!r}")
        if live and s.ended:
            raise ServiceError(410, f"session {session_id} has ended ({s.ended})")
        return s

    def heartbeat(self, namespace: str | None, session_id: Any) -> None:
        s = self.session(namespace, session_id)
        s.heartbeat = time.monotonic()

    def end_session(self, session: Session, why: str, status: dict | None = None) -> None:
        """End ``session`` (its models unloaded); ``status``: how, as the SDK's
        ``SessionStatus`` says it (a client's finish)."""
        with self.lock:
            if session.ended:
                return
            session.ended, session.status = why, status
            models = [self.models[m] for m in session.models if m in self.models]
        self.calls.note({"op": "end_session", "session_id": session.session_id})
        for model in models:
            self.unload(model, why)

    def end_silent_sessions(self) -> None:
        """End each session whose client sent no heartbeat for the limit's TTL."""
        now_s = time.monotonic()
        with self.lock:
            stale = [
                s
                for s in self.sessions.values()
                if not s.ended and now_s - s.heartbeat > self.limits.session_ttl_s
            ]
        for s in stale:
            self.end_session(s, f"no heartbeat for {self.limits.session_ttl_s:g} s")

    def session_ids(self, namespace: str | None) -> list[str]:
        with self.lock:
            return [s.session_id for s in self.sessions.values() if s.namespace == namespace]

    # ------------------------------------------------------------------- models

    def model(self, namespace: str | None, model_id: Any) -> Model:
        with self.lock:
            m = self.models.get(model_id) if isinstance(model_id, str) else None
        if m is None or m.namespace != namespace:
            raise not_found(f"no model {str(model_id)[:80]!r}")
        if m.ended:
            raise ServiceError(410, f"model {model_id} is unloaded ({m.ended})")
        return m

    def new_model(
        self,
        namespace: str | None,
        session_id: str,
        seq: int,
        base_model: str,
        lora: LoraSettings,
        meta: dict,
        seed: int | None = None,
    ) -> Model:
        session = self.session(namespace, session_id)
        self.base_uri(base_model)
        model_id = f"{session_id}:train:{int(seq)}"
        if seed is None:  # drawn here and journaled: a model made again starts the same
            seed = secrets.randbits(62)
        if not RUN_PATTERN.match(model_id):
            raise ServiceError(400, f"bad model_seq_id {seq!r}")
        with self.lock:
            if model_id in self.models:
                raise ServiceError(409, f"model {model_id} exists")
            live = sum(1 for m in self.models.values() if m.namespace == namespace and not m.ended)
            if live >= self.limits.max_models_per_namespace:
                raise ServiceError(  # 403, not 429: the SDK would retry a 429 for minutes
                    403,
                    f"at most {self.limits.max_models_per_namespace} live models per key: "
                    "close a session or unload a model first",
                )
            model = Model(model_id, namespace, session_id, base_model, lora, seed)
            self.models[model_id] = model
            session.models.append(model_id)
        run = {
            "training_run_id": model_id,
            "base_model": base_model,
            "lora": tinker_lora_config(lora, seed),
            "model_owner": namespace or "local",
            "created": now(),
            "user_metadata": {str(k): str(v) for k, v in (meta or {}).items()},
        }
        self.storage.write_json(f"{run_folder(namespace, model_id)}/run.json", run)
        self.calls.note(
            {
                "op": "model",
                "model_id": model_id,
                "ns": namespace,
                "session_id": session_id,
                "base_model": base_model,
                "lora": tinker_lora_config(lora, seed),
            }
        )
        spec = self.spec(model)

        def start() -> dict:
            try:
                model.handle = self.placement.start_model(spec)
            except BaseException as e:
                model.ended = f"it did not start: {type(e).__name__}: {e}"[:500]  # slot freed
                raise
            return {"model_id": model_id, "type": "create_model"}

        model.start = start
        return model

    def spec(self, model: Model) -> dict[str, Any]:
        """What the placement starts ``model`` from (``Placement.start_model``)."""
        return {
            "model_id": model.model_id,
            "namespace": model.namespace,
            "base_model": model.base_model,
            "base_uri": self.base_uri(model.base_model),
            "lora": model.lora,
            "seed": model.seed,
            "session_id": model.session_id,
            "generation": model.generation,
        }

    def unload(self, model: Model, why: str) -> None:
        with self.lock:
            if model.ended:
                return
            model.ended = why
        if model.session_id:  # a pool model (no session) is not in the journal
            self.calls.note({"op": "unload", "model_id": model.model_id})

        def stop() -> None:
            if model.handle is not None:
                model.handle.close()
                model.handle = None
            if model.restore_folder is not None:  # the state that cut its history
                self.storage.delete(model.restore_folder)

        model.worker.submit(stop)
        model.worker.shutdown(wait=False)

    def run_on(
        self,
        model: Model,
        kind: str,
        fn: Callable[[ModelHandle], Any],
        namespace: str | None = None,
        history: bool = False,
    ) -> str:
        """Queue ``fn(handle)`` on the model's worker; the id of the future, which belongs to
        ``namespace`` (default the model's; a shared sampling model's futures are the
        caller's). With ``history``, the call changes the weights: once it has run, it is
        journaled as part of the model's history (``journal.py``). A model whose weights were
        lost meanwhile (its actor died) is first made again from its history (``restore``,
        with a journal), and ``fn`` runs on it."""

        request_id = self.calls.next_request_id()

        def work() -> Any:
            if model.handle is None:
                raise ServiceError(410, f"model {model.model_id} is unloaded ({model.ended})")
            if request_id in model.redone:  # its restore ran it: the same answer, not twice
                return fn(Answered(model.redone.pop(request_id), model.handle.info))
            try:
                out = self._keyed(model, request_id, fn)
            except Exception as err:
                if self.restore is None or not actor_lost(err):
                    raise
                self.restore(model, f"{type(err).__name__}: {err}"[:300])
                out = self._keyed(model, request_id, fn)
            size = self.calls.body_bytes.pop(request_id, 0)
            if history:
                self.calls.note({"op": "ran", "model_id": model.model_id, "rid": request_id})
                model.history_bytes += size
                if self.bound_history is not None:
                    self.bound_history(model)
            return out

        try:
            return self.calls.submit(
                namespace or model.namespace, kind, model.worker, work, request_id
            )
        except RuntimeError:  # the worker was shut down: the model was unloaded meanwhile
            raise ServiceError(410, f"model {model.model_id} is unloaded ({model.ended})") from None

    @staticmethod
    def _keyed(model: Model, request_id: str, fn: Callable[[ModelHandle], Any]) -> Any:
        if model.handle is None:
            raise ServiceError(410, f"model {model.model_id} is lost ({model.ended})")
        work_for(request_id)  # its model calls are keyed: a replay runs none twice
        try:
            return fn(model.handle)
        finally:
            work_for(None)

    def create_model(self, namespace: str | None, req: Any) -> tuple[str, str]:
        """A ``CreateModelRequest``: the new model's start, queued; (future id, model id)."""
        lora, seed = training_lora(req.lora_config, req.optimizer_config)
        model = self.new_model(
            namespace,
            req.session_id,
            req.model_seq_id,
            req.base_model,
            lora,
            req.user_metadata or {},
            seed,
        )
        future = self.calls.submit(namespace, "create_model", model.worker, model.start)
        return future, model.model_id

    def unload_request(self, namespace: str | None, model_id: Any) -> tuple[str, str]:
        """A client's ``unload_model``: done at once; (future id of the answer, model id)."""
        model = self.model(namespace, model_id)
        self.unload(model, "unloaded by the client")
        answer = {"model_id": model.model_id, "type": "unload_model"}
        return self.calls.answered_now(model.namespace, answer), model.model_id
