"""The Tinker API's state and verbs: sessions and their heartbeats, training models (each on
its placement, with a worker thread that runs its calls in arrival order), futures, samplers,
runs and checkpoints in flowrl storage. ``routes`` puts HTTP in front of it; the checks of a
request's settings are ``types``'s, the paths ``checkpoints``'s.

Work is asynchronous as the SDK expects: a verb answers a future id at once and its work runs on
the model's own worker thread; ``retrieve_future`` (``routes``) answers the result. A namespace
sees only its own sessions, models, samplers, futures, runs and checkpoints (404 otherwise).
"""

from __future__ import annotations

import base64
import concurrent.futures
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from flowrl.backends.engines.tinker.types import (
    SampleParams,
    check_batch,
    check_fits,
    read_tinker_lora,
    tinker_lora,
    tinker_lora_config,
    training_lora,
)
from flowrl.backends.models.tinker_checkpoints import (
    KINDS,
    NAME_PATTERN,
    RUN_PATTERN,
    checkpoint_folder,
    not_found,
    run_folder,
    tinker_prefix,
)
from flowrl.backends.policy.placement import InProcess, Placement, place
from flowrl.backends.policy.tinker_handles import ModelHandle, work_for
from flowrl.backends.services.tinker.journal import Journal, pending
from flowrl.backends.services.tinker.wire import write_forward_output, write_sample_response
from flowrl.backends.types import LoraSettings
from flowrl.infra.serving import Keys, ServiceError, ServingLimits
from flowrl.infra.settings import get_settings
from flowrl.infra.storage import Storage


@dataclass
class Limits(ServingLimits):
    max_body_bytes: int = 64 * 2**20
    session_ttl_s: float = 120.0
    """A session whose client has not sent a heartbeat (every 10 s) for this long ends: its
    models are unloaded (slots freed), its saved states kept."""
    max_models_per_namespace: int = 8
    max_samples: int = 64
    future_ttl_s: float = 3600.0
    long_poll_s: float = 20.0
    """How long ``retrieve_future`` waits for a result before answering 408 ``try_again`` (the
    SDK asks again at once; its own timeout per ask is 45 s)."""


START_AGAIN_S = 300.0
"""How long a restarted service waits for a model whose start the killed one had begun."""


@dataclass
class _Session:
    session_id: str
    namespace: str | None
    display_name: str | None
    user_metadata: dict[str, str]
    heartbeat: float = field(default_factory=time.monotonic)
    models: list[str] = field(default_factory=list)
    samplers: list[str] = field(default_factory=list)
    ended: str | None = None


@dataclass
class _Model:
    model_id: str
    namespace: str | None
    session_id: str
    base_model: str
    lora: LoraSettings
    seed: int | None = None  # the client's LoraConfig.seed (None: the model draws one)
    handle: ModelHandle | None = None
    worker: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1, "tinker-model")
    )
    snapshots: int = 0
    ended: str | None = None
    start: Callable[[], Any] | None = None
    """Starts the model (its placement's ``start``) as the first work on its worker."""


@dataclass
class _Sampler:
    sampler_id: str
    namespace: str | None
    base_model: str
    model_path: str | None
    model_id: str | None  # the live training model whose worker samples, else a pool model
    weights: str | None  # the snapshot key on that model; None: the base model alone
    pool: _Model | None = None  # the model that serves a saved path (set when it is loaded)
    clients: int = 0


@dataclass
class _Future:
    namespace: str | None
    kind: str
    future: concurrent.futures.Future
    created: float = field(default_factory=time.monotonic)


def _live(model: _Model) -> ModelHandle:
    """The model's handle, or a 503 saying why it has none (its start failed)."""
    if model.handle is None:
        raise ServiceError(503, f"model {model.model_id} is not available ({model.ended})")
    return model.handle


def _now() -> str:
    return datetime.now(UTC).isoformat()


class TinkerService:
    """The service's state and verbs (``routes.create_app`` puts HTTP in front of it)."""

    def __init__(
        self,
        placement: Placement,
        catalogue: dict[str, str] | None = None,
        keys: dict[str, str] | None = None,
        storage_url: str | None = None,
        limits: Limits | None = None,
        sampler_placement: Placement | None = None,
        journal: Journal | None = None,
    ):
        settings = get_settings()
        self.placement = placement
        if sampler_placement is None:  # in this process; sharing the models' bases if they are
            in_process = isinstance(placement, InProcess)
            sampler_placement = placement if in_process else place("local")
        self.sampler_placement = sampler_placement
        # A sampling engine of its own (vLLM): every saved sampler weights, a live model's
        # too, is sampled there, never by a training model's worker.
        self.engine_samples = sampler_placement.kind == "vllm-engines"
        self.catalogue = dict(catalogue if catalogue is not None else settings.tinker_models)
        self.keys = Keys(keys)
        self.storage = Storage(storage_url or settings.storage_root)
        self.limits = limits or Limits()
        self.lock = threading.RLock()
        self.sessions: dict[str, _Session] = {}
        self.models: dict[str, _Model] = {}
        self.samplers: dict[str, _Sampler] = {}
        self.futures: dict[str, _Future] = {}
        self.pool: dict[tuple, _Model] = {}  # samplers of saved paths and base models
        self.try_again = 0  # 408 answers to retrieve_future (a result not ready in a long poll)
        self.journal = journal
        """Where what a restarted service needs is written (``journal.py``); None: nothing
        outlives the process."""
        self.answered: dict[tuple, dict] = {}  # (target, verb, seq_id) -> its answer
        self._answer_keys: dict[str, tuple] = {}  # future id -> its key in ``answered``
        self._replaying = threading.local()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, daemon=True, name="tinker-reaper")
        self._reaper.start()

    # ------------------------------------------------------------------- paths

    def prefix(self, namespace: str | None) -> str:
        return tinker_prefix(namespace)

    def run_dir(self, namespace: str | None, run_id: str) -> str:
        return run_folder(namespace, run_id)

    def parse_path(self, namespace: str | None, path: Any) -> tuple[str, str, str]:
        """(run id, kind, storage folder) of the caller's checkpoint at ``path``."""
        return checkpoint_folder(self.storage, namespace, path)

    def base_uri(self, name: str) -> str:
        if name not in self.catalogue:
            raise ServiceError(
                400,
                f"unknown base model {name[:120]!r} (this server has: {sorted(self.catalogue)})",
            )
        return self.catalogue[name]

    # ------------------------------------------------------------------- futures

    def submit(
        self,
        namespace: str | None,
        kind: str,
        worker: Any,
        fn: Callable[[], Any],
        request_id: str | None = None,
    ) -> str:
        request_id = request_id or self._next_request_id()
        future = worker.submit(fn)
        with self.lock:
            self.futures[request_id] = _Future(namespace, kind, future)
        return request_id

    def _next_request_id(self) -> str:
        """The id of the verb's future: the journal's (``journaled``), else a new one."""
        preset = getattr(self._replaying, "request_id", None)
        self._replaying.request_id = None
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
        request_id = getattr(self._replaying, "replay", None)
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
        self._replaying.request_id = request_id
        try:
            response = answer()
        except BaseException:
            self.done(request_id)  # refused at once: there is nothing to answer again
            raise
        finally:
            self._replaying.request_id = None
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

    def _note(self, entry: dict) -> None:
        if self.journal is not None:
            self.journal.write(entry)

    def recover(self, verbs: dict[str, Callable[[TinkerService, str | None, bytes], dict]]) -> str:
        """Carry on from the journal of a service that was stopped or killed: its live
        sessions, models and samplers, then each call whose result its client had not taken,
        under the same future id and in order (``journal.py``). One line saying what."""
        if self.journal is None:
            return "no journal"
        live = pending(self.journal.read())
        for e in live.sessions.values():
            session = _Session(e["session_id"], e["ns"], e.get("display_name"), e.get("meta") or {})
            self.sessions[session.session_id] = session
        found = 0
        starting = {c["target"] for c in live.calls if c["verb"] == "create_model"}
        for e in live.models.values():
            lora, seed = read_tinker_lora(e["lora"])
            model = _Model(e["model_id"], e["ns"], e["session_id"], e["base_model"], lora, seed)
            model.handle = self.placement.find_model(model.model_id)
            if model.handle is None and model.model_id not in starting:
                model.ended = "lost: the service restarted and the model was not found"
            found += model.handle is not None
            self.models[model.model_id] = model
            self.sessions[model.session_id].models.append(model.model_id)
        for e in live.samplers.values():
            self._restore_sampler(e)
        for call in live.calls:
            self._replay(call, verbs)
        self.journal.rewrite(live.entries())
        return (
            f"{len(live.sessions)} sessions, {found} of {len(live.models)} models, "
            f"{len(live.samplers)} samplers and {len(live.calls)} unanswered calls recovered"
        )

    def _replay(self, call: dict, verbs: dict) -> None:
        rid = call["rid"]
        if call["verb"] == "create_model":  # its session run was submitted: wait for it
            self._await_start(call)
            return
        self._replaying.replay = rid
        try:
            verbs[call["verb"]](self, call["ns"], base64.b64decode(call["body"]))
        except Exception as err:  # noqa: BLE001 - the client finds it on its future
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_exception(err)
            with self.lock:
                self.futures[rid] = _Future(call["ns"], call["verb"], failed)
        finally:
            self._replaying.replay = None

    def _await_start(self, call: dict) -> None:
        """The future of a ``create_model`` the killed service had begun: answered once the
        model's session run has its actor up (it was submitted before the kill)."""
        model = self.models[call["target"]]

        def wait() -> dict:
            deadline = time.monotonic() + START_AGAIN_S
            while model.handle is None:
                model.handle = self.placement.find_model(model.model_id)
                if model.handle is None:
                    if time.monotonic() > deadline:
                        model.ended = "it did not start after the service restarted"
                        raise ServiceError(503, f"model {model.model_id} {model.ended}")
                    time.sleep(1.0)
            return {"model_id": model.model_id, "type": "create_model"}

        self.submit(call["ns"], "create_model", model.worker, wait, call["rid"])

    def _restore_sampler(self, e: dict) -> None:
        sampler = _Sampler(
            e["sampler_id"], e["ns"], e["base_model"], e["model_path"], e["model_id"], e["weights"]
        )
        try:
            if e["model_path"] and e["model_id"] is None:  # a saved path on a pool model
                _, _, folder = self.parse_path(e["ns"], e["model_path"])
                record = self.checkpoint_record(folder)
                lora, seed = read_tinker_lora(record["lora"])
                target = self.sampler_pool_model(record["base_model"], lora, seed)
                data = self.storage.read_bytes(f"{folder}/adapter.safetensors")
                path = e["model_path"]
                target.worker.submit(lambda: _live(target).call("add_snapshot_bytes", path, data))
                sampler.pool = target
            elif e["model_id"] is not None and e["model_id"] in self.models:
                sampler.pool = self.models[e["model_id"]] if e["model_path"] else None
        except ServiceError:
            return  # its checkpoint was deleted meanwhile: the sampler is gone
        self.samplers[sampler.sampler_id] = sampler
        self.sessions[e["session_id"]].samplers.append(sampler.sampler_id)

    def future(self, namespace: str | None, request_id: str) -> _Future:
        with self.lock:
            entry = self.futures.get(request_id) if isinstance(request_id, str) else None
        if entry is None or entry.namespace != namespace:
            raise not_found(f"no future {str(request_id)[:80]!r}")
        return entry

    # ------------------------------------------------------------------- sessions

    def create_session(self, namespace: str | None, body: dict) -> str:
        session_id = secrets.token_hex(8)
        meta = body.get("user_metadata") or {}
        if not isinstance(meta, dict):
            raise ServiceError(400, "user_metadata must be an object")
        with self.lock:
            self.sessions[session_id] = _Session(
                session_id,
                namespace,
                body.get("display_name"),
                {str(k): str(v) for k, v in meta.items()},
            )
        s = self.sessions[session_id]
        self._note(
            {
                "op": "session",
                "session_id": session_id,
                "ns": namespace,
                "display_name": s.display_name,
                "meta": s.user_metadata,
            }
        )
        return session_id

    def session(self, namespace: str | None, session_id: Any, live: bool = True) -> _Session:
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

    def end_session(self, session: _Session, why: str) -> None:
        with self.lock:
            if session.ended:
                return
            session.ended = why
            models = [self.models[m] for m in session.models if m in self.models]
        self._note({"op": "end_session", "session_id": session.session_id})
        for model in models:
            self.unload(model, why)

    def _reap(self) -> None:
        while not self._stop.wait(1.0):
            now = time.monotonic()
            with self.lock:
                stale = [
                    s
                    for s in self.sessions.values()
                    if not s.ended and now - s.heartbeat > self.limits.session_ttl_s
                ]
                old = [
                    k
                    for k, f in self.futures.items()
                    if f.future.done() and now - f.created > self.limits.future_ttl_s
                ]
                for k in old:
                    del self.futures[k]
            for s in stale:
                self.end_session(s, f"no heartbeat for {self.limits.session_ttl_s:g} s")

    def close(self) -> None:
        """Stop: every session ends, unless a journal keeps them for the next service (their
        models live on in their session runs, and end with no heartbeat past the TTL)."""
        self._stop.set()
        with self.lock:
            sessions = list(self.sessions.values()) if self.journal is None else []
            pool = list(self.pool.values())
        for s in sessions:
            self.end_session(s, "server stopped")
        for model in pool:
            self.unload(model, "server stopped")

    # ------------------------------------------------------------------- models

    def model(self, namespace: str | None, model_id: Any) -> _Model:
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
    ) -> _Model:
        session = self.session(namespace, session_id)
        uri = self.base_uri(base_model)
        model_id = f"{session_id}:train:{int(seq)}"
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
            model = _Model(model_id, namespace, session_id, base_model, lora, seed)
            self.models[model_id] = model
            session.models.append(model_id)
        run = {
            "training_run_id": model_id,
            "base_model": base_model,
            "lora": tinker_lora_config(lora, seed),
            "model_owner": namespace or "local",
            "created": _now(),
            "user_metadata": {str(k): str(v) for k, v in (meta or {}).items()},
        }
        self.storage.write_json(f"{self.run_dir(namespace, model_id)}/run.json", run)
        self._note(
            {
                "op": "model",
                "model_id": model_id,
                "ns": namespace,
                "session_id": session_id,
                "base_model": base_model,
                "lora": tinker_lora_config(lora, seed),
            }
        )
        spec = {
            "model_id": model_id,
            "namespace": namespace,
            "base_model": base_model,
            "base_uri": uri,
            "lora": lora,
            "seed": seed,
            "session_id": session_id,
        }

        def start() -> dict:
            try:
                model.handle = self.placement.start_model(spec)
            except BaseException as e:
                model.ended = f"it did not start: {type(e).__name__}: {e}"[:500]  # slot freed
                raise
            return {"model_id": model_id, "type": "create_model"}

        model.start = start
        return model

    def unload(self, model: _Model, why: str) -> None:
        with self.lock:
            if model.ended:
                return
            model.ended = why
        if model.session_id:  # a pool model (no session) is not in the journal
            self._note({"op": "unload", "model_id": model.model_id})

        def stop() -> None:
            if model.handle is not None:
                model.handle.close()
                model.handle = None

        model.worker.submit(stop)
        model.worker.shutdown(wait=False)

    def run_on(
        self,
        model: _Model,
        kind: str,
        fn: Callable[[ModelHandle], Any],
        namespace: str | None = None,
    ) -> str:
        """Queue ``fn(handle)`` on the model's worker; the id of the future, which belongs to
        ``namespace`` (default the model's; a shared sampling model's futures are the
        caller's)."""

        request_id = self._next_request_id()

        def work() -> Any:
            if model.handle is None:
                raise ServiceError(410, f"model {model.model_id} is unloaded ({model.ended})")
            work_for(request_id)  # its model calls are keyed: a replay runs none twice
            try:
                return fn(model.handle)
            finally:
                work_for(None)

        try:
            return self.submit(namespace or model.namespace, kind, model.worker, work, request_id)
        except RuntimeError:  # the worker was shut down: the model was unloaded meanwhile
            raise ServiceError(410, f"model {model.model_id} is unloaded ({model.ended})") from None

    # ------------------------------------------------------------------- checkpoints

    def save(self, model: _Model, kind: str, name: str | None, optimizer: bool, meta: dict) -> str:
        """Queue a save of ``model`` as ``kind`` (weights | sampler_weights) named ``name``."""
        if name is None:
            name = f"{'state' if kind == 'weights' else 'sampler'}-{secrets.token_hex(4)}"
        if not NAME_PATTERN.match(name):
            raise ServiceError(400, f"bad checkpoint name {name[:80]!r} (letters, digits, . _ -)")
        folder = f"{self.run_dir(model.namespace, model.model_id)}/{kind}/{name}"
        path = f"tinker://{model.model_id}/{kind}/{name}"
        storage = self.storage

        def work(handle: ModelHandle) -> dict:
            files = handle.call("state_bytes", optimizer)
            for file, data in files.items():
                storage.write_bytes(f"{folder}/{file}", data)
            record = {
                "checkpoint_id": f"{kind}/{name}",
                "checkpoint_type": KINDS[kind],
                "time": _now(),
                "tinker_path": path,
                "size_bytes": sum(len(v) for v in files.values()),
                "user_metadata": {str(k): str(v) for k, v in (meta or {}).items()} or None,
                "base_model": model.base_model,
                "lora": tinker_lora_config(model.lora, model.seed),
            }
            storage.write_json(f"{folder}/checkpoint.json", record)
            if kind == "sampler_weights":
                handle.call("add_snapshot_bytes", path, files["adapter.safetensors"])
            return {
                "path": path,
                "type": "save_weights" if kind == "weights" else "save_weights_for_sampler",
            }

        return self.run_on(model, "save", work)

    def read_checkpoint(self, folder: str, optimizer: bool) -> dict[str, bytes]:
        files = {"adapter.safetensors": self.storage.read_bytes(f"{folder}/adapter.safetensors")}
        if optimizer:
            if not self.storage.exists(f"{folder}/optimizer.pt"):
                raise ServiceError(400, "this checkpoint has no optimizer state")
            files["optimizer.pt"] = self.storage.read_bytes(f"{folder}/optimizer.pt")
        return files

    def checkpoint_record(self, folder: str) -> dict:
        return self.storage.read_json(f"{folder}/checkpoint.json")

    def runs(self, namespace: str | None) -> list[dict]:
        prefix = self.prefix(namespace)
        out = []
        for entry in self.storage.list(prefix) if self.storage.exists(prefix) else []:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if self.storage.exists(f"{prefix}/{name}/run.json"):
                out.append(self.storage.read_json(f"{prefix}/{name}/run.json"))
        return sorted(out, key=lambda r: r.get("created", ""), reverse=True)

    def checkpoints(self, namespace: str | None, run_id: str) -> list[dict]:
        run_dir = self.run_dir(namespace, run_id)
        if not self.storage.exists(f"{run_dir}/run.json"):
            raise not_found(f"no training run {run_id!r}")
        out = []
        for kind in KINDS:
            base = f"{run_dir}/{kind}"
            if not self.storage.exists(base):
                continue
            for entry in self.storage.list(base):
                name = entry.rstrip("/").rsplit("/", 1)[-1]
                if self.storage.exists(f"{base}/{name}/checkpoint.json"):
                    out.append(self.storage.read_json(f"{base}/{name}/checkpoint.json"))
        return sorted(out, key=lambda c: c["time"])

    # ------------------------------------------------------------------- samplers

    def sampler_pool_model(
        self, base_model: str, lora: LoraSettings, seed: int | None = None
    ) -> _Model:
        """A model of this service for sampling saved paths of ``lora``'s shape (or the base
        model alone), shared by every caller: it holds no one's training state."""
        key = (base_model, tuple(sorted(tinker_lora_config(lora, seed).items())))
        with self.lock:
            model = self.pool.get(key)
            if model is None:
                model = _Model(f"pool-{len(self.pool)}", None, "", base_model, lora, seed)
                self.pool[key] = model
                uri = self.base_uri(base_model)
                spec = {
                    "model_id": model.model_id,
                    "namespace": None,
                    "base_model": base_model,
                    "base_uri": uri,
                    "lora": lora,
                    "seed": seed,
                    "session_id": "",
                }

                def start() -> None:
                    try:
                        model.handle = self.sampler_placement.start_model(spec)
                    except Exception as err:
                        model.ended = f"its start failed: {type(err).__name__}: {err}"[:500]
                        raise

                model.worker.submit(start)
        return model

    def add_sampler(self, namespace: str | None, session: _Session, sampler: _Sampler) -> str:
        with self.lock:
            self.samplers[sampler.sampler_id] = sampler
            session.samplers.append(sampler.sampler_id)
        self._note(
            {
                "op": "sampler",
                "sampler_id": sampler.sampler_id,
                "ns": namespace,
                "session_id": session.session_id,
                "base_model": sampler.base_model,
                "model_path": sampler.model_path,
                "model_id": sampler.model_id,
                "weights": sampler.weights,
            }
        )
        return sampler.sampler_id

    def sampler(self, namespace: str | None, sampler_id: Any) -> _Sampler:
        with self.lock:
            s = self.samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        if s is None or s.namespace != namespace:
            raise not_found(f"no sampler {str(sampler_id)[:80]!r}")
        return s

    def sampler_from_path(self, namespace: str | None, session: _Session, path: str) -> str:
        run_id, kind, folder = self.parse_path(namespace, path)
        record = self.checkpoint_record(folder)
        lora, seed = read_tinker_lora(record["lora"])
        with self.lock:
            live = self.models.get(run_id)
        serves = live is not None and not live.ended and live.namespace == namespace
        if serves and not self.engine_samples:
            target = live
        else:
            target = self.sampler_pool_model(record["base_model"], lora, seed)
        data = self.storage.read_bytes(f"{folder}/adapter.safetensors")
        target.worker.submit(lambda: _live(target).call("add_snapshot_bytes", path, data)).result()
        sampler = _Sampler(
            f"{session.session_id}:sample:{secrets.token_hex(4)}",
            namespace,
            record["base_model"],
            path,
            target.model_id if target is live else None,
            path,
            pool=target,
        )
        return self.add_sampler(namespace, session, sampler)

    def sampler_target(self, sampler: _Sampler) -> _Model:
        if sampler.pool is not None:
            return sampler.pool
        if sampler.model_id is not None:
            return self.model(sampler.namespace, sampler.model_id)
        return self.sampler_pool_model(sampler.base_model, tinker_lora(rank=1))

    # ------------------------------------------------------------------- requests
    # One method per request that needs more than a lookup; the routes parse and answer.

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
        return self.submit(namespace, "create_model", model.worker, model.start), model.model_id

    def unload_request(self, namespace: str | None, model_id: Any) -> tuple[str, str]:
        """A client's ``unload_model``: done at once; (future id of the answer, model id)."""
        model = self.model(namespace, model_id)
        done: concurrent.futures.Future = concurrent.futures.Future()
        done.set_result({"model_id": model.model_id, "type": "unload_model"})
        self.unload(model, "unloaded by the client")
        request_id = secrets.token_hex(12)
        with self.lock:
            self.futures[request_id] = _Future(model.namespace, "unload", done)
        return request_id, model.model_id

    def forward_backward(self, namespace: str | None, call: Any) -> tuple[str, str]:
        """A decoded ``forward_backward`` / ``forward`` call, checked against the model's
        vocabulary when it is up (and by the model again, once it is); (future id, model id)."""
        model = self.model(namespace, call.model_id)
        if model.handle is not None:
            check_batch(call.data, call.loss_fn, call.config, model.handle.info["vocab_size"])

        def work(handle: ModelHandle) -> bytes:
            out = handle.call(
                "forward_backward", call.data, call.loss_fn, call.config, call.forward_only
            )
            return write_forward_output(out)

        return self.run_on(model, "forward_backward", work), model.model_id

    def optim_step(self, namespace: str | None, model_id: Any, adam: dict) -> tuple[str, str]:
        """One AdamW step with checked parameters (``types.adam_step``)."""
        model = self.model(namespace, model_id)

        def work(handle: ModelHandle) -> dict:
            return {"metrics": handle.call("optim_step", **adam)}

        return self.run_on(model, "optim_step", work), model.model_id

    def snapshot_for_sampler(self, namespace: str | None, model_id: Any) -> tuple[str, str]:
        """``save_weights_for_sampler`` without a path: a sampler of the model's weights as
        they are now, kept on the model (no storage)."""
        model = self.model(namespace, model_id)
        session = self.session(namespace, model.session_id)
        with self.lock:
            model.snapshots += 1
            key = f"snapshot-{model.snapshots}"
        if self.engine_samples:  # one engine samples every model's snapshots: keys of the model
            key = f"{model.model_id}/{key}"
        sampler_id = self.add_sampler(
            namespace,
            session,
            _Sampler(
                f"{model.model_id}:snapshot:{model.snapshots}",
                namespace,
                model.base_model,
                None,
                model.model_id,
                key,
            ),
        )

        if self.engine_samples:  # the adapter as it is now goes to the engine, by this key
            pool = self.sampler_pool_model(model.base_model, model.lora, model.seed)
            self.samplers[sampler_id].pool = pool

        def work(handle: ModelHandle) -> dict:
            if self.engine_samples:
                data = handle.call("state_bytes", False)["adapter.safetensors"]
                pool.worker.submit(
                    lambda: _live(pool).call("add_snapshot_bytes", key, data)
                ).result()
            else:
                handle.call("snapshot", key)
            return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        return self.run_on(model, "save_weights_for_sampler", work), model.model_id

    def load_weights(self, namespace: str | None, req: Any) -> tuple[str, str]:
        """A ``LoadWeightsRequest``: a saved state into a live model of the same base and
        adapter shape (``model_id``), or into a new model (``session_id`` + ``model_seq_id``)."""
        _, kind, folder = self.parse_path(namespace, req.path)
        if req.optimizer and kind != "weights":
            raise ServiceError(
                400, "a sampler checkpoint has no optimizer state (save_state saves one)"
            )
        record = self.checkpoint_record(folder)
        lora, seed = read_tinker_lora(record["lora"])
        if req.model_id is not None:
            model = self.model(namespace, req.model_id)
            # The adapter's shape must match; its init seed need not.
            if lora != model.lora or record["base_model"] != model.base_model:
                raise ServiceError(
                    400, f"{req.path} was saved from another base model or LoRA shape"
                )
        else:
            model = self._model_for_state(namespace, req, record, lora, seed)
        files = self.read_checkpoint(folder, req.optimizer)
        start = model.start if model.handle is None else None
        path, optimizer = req.path, req.optimizer

        def work(handle: ModelHandle | None = None) -> dict:
            if start is not None:
                start()
            model.handle.call("load_state_bytes", files, optimizer)
            return {"path": path, "model_id": model.model_id, "type": "load_weights"}

        if start is not None:
            return self.submit(namespace, "load_weights", model.worker, work), model.model_id
        return self.run_on(model, "load_weights", work), model.model_id

    def _model_for_state(
        self, namespace: str | None, req: Any, record: dict, lora: LoraSettings, seed: int | None
    ) -> _Model:
        """The new model a saved state loads into (``create_training_client_from_state``)."""
        if req.session_id is None or req.model_seq_id is None:
            raise ServiceError(400, "load_weights needs model_id, or session_id and model_seq_id")
        base = req.base_model or record["base_model"]
        if base != record["base_model"]:
            raise ServiceError(
                400, f"{req.path} was trained on {record['base_model']!r}, not {base!r}"
            )
        meta = req.user_metadata or {}
        return self.new_model(namespace, req.session_id, req.model_seq_id, base, lora, meta, seed)

    def create_sampler(self, namespace: str | None, req: Any) -> str:
        """A ``CreateSamplingSessionRequest``: a sampler of a saved path or of a base model."""
        session = self.session(namespace, req.session_id)
        if req.model_path:
            return self.sampler_from_path(namespace, session, req.model_path)
        if not req.base_model:
            raise ServiceError(400, "create_sampling_session needs model_path or base_model")
        self.base_uri(req.base_model)
        sampler = _Sampler(
            f"{session.session_id}:sample:{secrets.token_hex(4)}",
            namespace,
            req.base_model,
            None,
            None,
            None,
        )
        return self.add_sampler(namespace, session, sampler)

    def sample(
        self,
        namespace: str | None,
        sampler_id: Any,
        prompt: list[int],
        n: int,
        params: SampleParams,
        prompt_logprobs: bool,
    ) -> str:
        """Queue ``n`` samples of ``prompt`` on the sampler's model; the future's id (the
        caller's, also when the model is a shared pool model)."""
        sampler = self.sampler(namespace, sampler_id)
        target = self.sampler_target(sampler)
        if target.handle is not None:  # else checked on the model's worker, once it is up
            check_fits(prompt, params, target.handle.info)
        weights = sampler.weights

        def work(handle: ModelHandle) -> bytes:  # the model checks prompt and context again
            return write_sample_response(
                handle.call("sample", prompt, n, params, weights, prompt_logprobs)
            )

        return self.run_on(target, "sample", work, namespace=namespace)

    # ------------------------------------------------------------------- listings

    def session_ids(self, namespace: str | None) -> list[str]:
        with self.lock:
            return [s.session_id for s in self.sessions.values() if s.namespace == namespace]

    def join_sampler(self, namespace: str | None, sampler_id: Any) -> int:
        """One more client of a sampler; how many it has."""
        sampler = self.sampler(namespace, sampler_id)
        with self.lock:
            sampler.clients += 1
            return sampler.clients

    def run_record(self, namespace: str | None, run_id: str) -> dict:
        return self.storage.read_json(f"{self.run_dir(namespace, run_id)}/run.json")

    def delete_checkpoint(self, namespace: str | None, path: str) -> None:
        _, _, folder = self.parse_path(namespace, path)
        self.storage.delete(folder)

    def all_checkpoints(self, namespace: str | None) -> list[dict]:
        """Every checkpoint of every run of the namespace."""
        out: list[dict] = []
        for run in self.runs(namespace):
            out += self.checkpoints(namespace, run["training_run_id"])
        return out
