"""The Tinker API's state and verbs, one part per resource, each owning its state:

- ``calls`` (``calls.py``): futures, the journal, the answers a client's retry gets again;
- ``registry`` (``registry.py``): sessions and their heartbeats, training models on their
  placement, each with a worker thread that runs its calls in arrival order;
- ``training`` (``training.py``): ``forward_backward``, ``optim_step``, loading a state;
- ``sampling`` (``sampling.py``): samplers, ``sample``, the pool models of saved paths;
- ``checkpoints`` (``checkpoints.py``): runs and checkpoints in flowrl storage.

``TinkerService`` builds them, ends silent sessions, and carries on from a journal after a
restart (``recover``). ``routes`` puts HTTP in front; the checks of a request's settings are
``engines.tinker.types``'s, the paths ``models.tinker_checkpoints``'s.

Work is asynchronous as the SDK expects: a verb answers a future id at once and its work runs on
the model's own worker thread; ``retrieve_future`` (``routes``) answers the result. A namespace
sees only its own sessions, models, samplers, futures, runs and checkpoints (404 otherwise).
"""

from __future__ import annotations

import base64
import concurrent.futures
import os
import sys
import threading
import time
from collections.abc import Callable

from flowrl.backends.engines.tinker.custom_loss import compile_loss
from flowrl.backends.engines.tinker.types import read_tinker_lora
from flowrl.backends.policy.placement import InProcess, Placement, place
from flowrl.backends.policy.tinker_handles import ray_cluster_gone
from flowrl.backends.services.tinker.calls import Calls
from flowrl.backends.services.tinker.checkpoints import Checkpoints
from flowrl.backends.services.tinker.export import Exports
from flowrl.backends.services.tinker.journal import Journal, pending
from flowrl.backends.services.tinker.registry import Registry
from flowrl.backends.services.tinker.sampling import Sampling
from flowrl.backends.services.tinker.state import Future, Limits, Model, Session
from flowrl.backends.services.tinker.training import Training
from flowrl.infra.serving import Keys, ServiceError
from flowrl.infra.settings import get_settings
from flowrl.infra.storage import Storage

__all__ = ["Limits", "TinkerService"]

SWEEP_S = 600.0
"""How often the service deletes expired checkpoints (a read of one also deletes it)."""
RAY_WATCH_S = 5.0
"""How often a service with a journal asks whether its Ray cluster is still there."""
RAY_GONE_EXIT = 75
"""The exit status of a service whose Ray cluster is gone (``EX_TEMPFAIL``)."""
START_AGAIN_S = 300.0
"""How long a restarted service waits for a model whose start the killed one had begun."""


class TinkerService:
    """The service (see the module docstring): its parts, its keys and limits, the sessions'
    reaper, and recovery from a journal."""

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
        self.catalogue = dict(catalogue if catalogue is not None else settings.tinker_models)
        self.keys = Keys(keys)
        self.storage = Storage(storage_url or settings.storage_root)
        self.limits = limits or Limits()
        self.lock = threading.RLock()
        self.journal = journal
        """Where what a restarted service needs is written (``journal.py``); None: nothing
        outlives the process."""
        self.calls = Calls(self.lock, journal)
        self.registry = Registry(placement, self.catalogue, self.limits, self.storage, self.calls)
        self.checkpoints = Checkpoints(self.storage, self.registry)
        self.exports = Exports(self.checkpoints)
        self.training = Training(self.registry, self.checkpoints)
        self.sampling = Sampling(sampler_placement, self.registry, self.checkpoints)
        self.sessions = self.registry.sessions  # by id (tests and tools read them)
        if journal is not None:  # a lost model can be made again from its history
            self.registry.restore = self._restore
            self.registry.bound_history = self.training.bound_history
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap, daemon=True, name="tinker-reaper")
        self._reaper.start()
        if journal is not None and not isinstance(placement, InProcess):
            watch = threading.Thread(target=self._watch_ray, daemon=True, name="tinker-ray")
            watch.start()

    @property
    def try_again(self) -> int:
        """408 answers to ``retrieve_future`` so far (a result not ready in a long poll)."""
        return self.calls.try_again

    def _reap(self) -> None:
        swept = time.monotonic()
        while not self._stop.wait(1.0):
            self.calls.expire(self.limits.future_ttl_s)
            self.registry.end_silent_sessions()
            if time.monotonic() - swept > SWEEP_S:
                swept = time.monotonic()
                try:
                    self.checkpoints.sweep()
                except Exception as err:  # noqa: BLE001 - storage down: the next sweep
                    print(f"checkpoint sweep: {type(err).__name__}: {err}", file=sys.stderr)

    def _watch_ray(self) -> None:
        """A service with a journal whose Ray cluster is gone (its head died and was started
        again: a new cluster, which this process cannot join again) exits, to be started again
        by its supervisor on its journal: its models are then made again (``recover``)."""
        while not self._stop.wait(RAY_WATCH_S):
            self._exit_if_ray_is_gone()

    def _exit_if_ray_is_gone(self) -> None:
        why = ray_cluster_gone()
        if why is None or self._stop.wait(RAY_WATCH_S):
            return
        why = ray_cluster_gone()  # twice in a row: not a GCS that is only slow to answer
        if why is not None:
            print(
                f"the Ray cluster this service joined is gone ({why}): exiting, to start "
                "again on the journal",
                file=sys.stderr,
                flush=True,
            )
            os._exit(RAY_GONE_EXIT)

    def _restore(self, model: Model, why: str) -> None:
        """A model whose actor was lost under a call: made again here, unless the Ray cluster
        went with it (then this service exits, and the next one makes it again)."""
        if not isinstance(self.placement, InProcess):
            self._exit_if_ray_is_gone()
        self.training.restore(model, why)

    def close(self) -> None:
        """Stop: every session ends, unless a journal keeps them for the next service (their
        models live on in their session runs, and end with no heartbeat past the TTL)."""
        self._stop.set()
        with self.lock:
            sessions = list(self.sessions.values()) if self.journal is None else []
            pool = list(self.sampling.pool.values())
        for s in sessions:
            self.registry.end_session(s, "server stopped")
        for model in pool:
            self.registry.unload(model, "server stopped")

    # ------------------------------------------------------------------- recovery

    def recover(self, verbs: dict[str, Callable[[TinkerService, str | None, bytes], dict]]) -> str:
        """Carry on from the journal of a service that was stopped or killed: its live
        sessions, models and samplers, then each call whose result its client had not taken,
        under the same future id and in order (``journal.py``). One line saying what."""
        if self.journal is None:
            return "no journal"
        live = pending(self.journal.read())
        for e in live.sessions.values():
            session = Session(e["session_id"], e["ns"], e.get("display_name"), e.get("meta") or {})
            session.project_id, session.tags = e.get("project_id"), e.get("tags") or []
            session.created_at = e.get("created_at") or session.created_at
            self.sessions[session.session_id] = session
        for e in live.losses.values():
            loss = compile_loss(e["name"], e["inputs"], e["graph"])
            self.sessions[e["session_id"]].losses[e["loss_id"]] = loss
        found, lost = 0, []
        starting = {c["target"] for c in live.calls if c["verb"] == "create_model"}
        for e in live.models.values():
            lora, seed = read_tinker_lora(e["lora"])
            model = Model(e["model_id"], e["ns"], e["session_id"], e["base_model"], lora, seed)
            model.generation, model.restoring = e.get("generation", 0), e.get("restoring")
            model.handle = self.placement.find_model(model.model_id, model.generation)
            if model.handle is None and model.model_id not in starting:
                lost.append(model)
            elif model.restoring is not None:  # found: a restore begun since was not needed
                orphan = self.placement.find_model(model.model_id, model.restoring)
                if orphan is not None:
                    orphan.close()
            found += model.handle is not None
            self.registry.models[model.model_id] = model
            self.sessions[model.session_id].models.append(model.model_id)
        for model in lost:  # made again from its history, first on its worker (``restore``)
            wanted = {c["rid"] for c in live.calls if c["target"] == model.model_id}
            why = "the service restarted and the model was not found"
            model.worker.submit(self.training.restore, model, why, wanted)
        for e in live.samplers.values():
            self.sampling.restore(e)
        for call in live.calls:
            self._replay(call, verbs)
        self.journal.rewrite(live.entries())
        return (
            f"{len(live.sessions)} sessions, {found} of {len(live.models)} models "
            f"({len(lost)} to make again from their history), {len(live.samplers)} samplers "
            f"and {len(live.calls)} unanswered calls recovered"
        )

    def _replay(self, call: dict, verbs: dict) -> None:
        rid = call["rid"]
        if call["verb"] == "create_model":  # its session run was submitted: wait for it
            self._await_start(call)
            return
        self.calls.replaying.replay = rid
        try:
            verbs[call["verb"]](self, call["ns"], base64.b64decode(call["body"]))
        except Exception as err:  # noqa: BLE001 - the client finds it on its future
            failed: concurrent.futures.Future = concurrent.futures.Future()
            failed.set_exception(err)
            with self.lock:
                self.calls.futures[rid] = Future(call["ns"], call["verb"], failed)
        finally:
            self.calls.replaying.replay = None

    def _await_start(self, call: dict) -> None:
        """The future of a ``create_model`` the killed service had begun: answered once the
        model's session run has its actor up (it was submitted before the kill)."""
        model = self.registry.models[call["target"]]

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

        self.calls.submit(call["ns"], "create_model", model.worker, wait, call["rid"])
