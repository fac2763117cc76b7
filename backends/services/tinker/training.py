"""The Tinker service's training verbs on a model: ``forward_backward`` (and ``forward``),
``optim_step``, and loading a saved state into a live or a new model. Each runs on the model's
worker (``Registry.run_on``) and answers a future id at once. With a journal, a model whose
weights were lost (its actor died, or the Ray head with it; it lived in a killed service) is
made again exactly from its history (``restore``)."""

from __future__ import annotations

import base64
import contextlib
import json
import secrets
import sys
import time
from collections.abc import Collection
from typing import Any

from flowrl.backends.engines.tinker.custom_loss import CustomLoss, compile_loss
from flowrl.backends.engines.tinker.types import adam_step, check_batch, read_tinker_lora
from flowrl.backends.models.tinker_checkpoints import run_folder
from flowrl.backends.policy.tinker_handles import ModelHandle, work_for
from flowrl.backends.services.tinker.checkpoints import Checkpoints
from flowrl.backends.services.tinker.journal import pending
from flowrl.backends.services.tinker.registry import Registry
from flowrl.backends.services.tinker.state import Model
from flowrl.backends.services.tinker.wire import read_forward_backward, write_forward_output
from flowrl.backends.types import LoraSettings
from flowrl.infra.serving import ServiceError

HISTORY_BYTES = 16 * 2**20
"""A model's history past this many journaled bytes is cut by a save of its state."""


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Training:
    """The verbs that change or read a training model's weights, and a lost model's restore
    from its history (with a journal)."""

    def __init__(self, registry: Registry, checkpoints: Checkpoints):
        self.registry = registry
        self.checkpoints = checkpoints

    def forward_backward(self, namespace: str | None, call: Any) -> tuple[str, str]:
        """A decoded ``forward_backward`` / ``forward`` call, checked against the model's
        vocabulary when it is up (and by the model again, once it is); (future id, model id)."""
        model = self.registry.model(namespace, call.model_id)
        custom = self._custom(model, call)
        if model.handle is not None:
            needs = None if custom is None else custom.inputs[1:]
            vocab = model.handle.info["vocab_size"]
            check_batch(call.data, call.loss_fn, call.config, vocab, custom_inputs=needs)

        def work(handle: ModelHandle) -> bytes:
            out = handle.call(
                "forward_backward",
                call.data,
                call.loss_fn,
                call.config,
                call.forward_only,
                custom=custom,
            )
            return write_forward_output(out)

        future = self.registry.run_on(
            model, "forward_backward", work, history=not call.forward_only
        )
        return future, model.model_id

    def _custom(self, model: Model, call: Any) -> CustomLoss | None:
        """The uploaded loss a ``custom`` call names (None for the built-in losses)."""
        if call.loss_fn != "custom":
            return None
        return self.custom_loss(model, call.loss_id)

    def create_custom_loss(self, namespace: str | None, req: Any) -> str:
        """A ``CreateCustomLossRequest``: its graph checked against the allow-list
        (``engines.tinker.custom_loss``; a 400 names what is refused) and kept in the session;
        the loss id (the same again for a retry of the same request)."""
        session = self.registry.session(namespace, req.session_id)
        loss_id = f"{session.session_id}:loss:{int(req.custom_loss_seq_id)}"
        inputs = [i.model_dump() for i in req.inputs]
        graph = req.graph.model_dump(mode="json")
        loss = compile_loss(req.name, inputs, graph)
        with self.registry.lock:
            if loss_id in session.losses:
                return loss_id
            session.losses[loss_id] = loss
        entry = {"session_id": session.session_id, "loss_id": loss_id, "name": req.name}
        self.registry.calls.note({"op": "custom_loss", **entry, "inputs": inputs, "graph": graph})
        return loss_id

    def custom_loss(self, model: Model, loss_id: str | None) -> CustomLoss:
        """The loss ``loss_id`` of ``model``'s session (a 400 otherwise)."""
        session = self.registry.sessions.get(model.session_id)
        loss = session.losses.get(loss_id or "") if session is not None else None
        if loss is None:
            raise ServiceError(
                400,
                f"no custom loss {str(loss_id)[:80]!r} in this model's session "
                "(create_custom_loss makes one)",
            )
        return loss

    def optim_step(self, namespace: str | None, model_id: Any, adam: dict) -> tuple[str, str]:
        """One AdamW step with checked parameters (``types.adam_step``)."""
        model = self.registry.model(namespace, model_id)

        def work(handle: ModelHandle) -> dict:
            return {"metrics": handle.call("optim_step", **adam)}

        return self.registry.run_on(model, "optim_step", work, history=True), model.model_id

    def load_weights(self, namespace: str | None, req: Any) -> tuple[str, str]:
        """A ``LoadWeightsRequest``: a saved state into a live model of the same base and
        adapter shape (``model_id``), or into a new model (``session_id`` + ``model_seq_id``)."""
        if req.weights_access_token is not None:
            raise ServiceError(400, "weights_access_token: external weights are not served here")
        _, kind, folder = self.checkpoints.parse_path(namespace, req.path, public=True)
        if req.optimizer and kind != "weights":
            raise ServiceError(
                400, "a sampler checkpoint has no optimizer state (save_state saves one)"
            )
        record = self.checkpoints.record(folder)
        lora, seed = read_tinker_lora(record["lora"])
        if req.model_id is not None:
            model = self.registry.model(namespace, req.model_id)
            # The adapter's shape must match; its init seed need not.
            if lora != model.lora or record["base_model"] != model.base_model:
                raise ServiceError(
                    400, f"{req.path} was saved from another base model or LoRA shape"
                )
        else:
            model = self._model_for_state(namespace, req, record, lora, seed)
        files = self.checkpoints.read(folder, req.optimizer)
        start = model.start if model.handle is None else None
        path, optimizer = req.path, req.optimizer

        def work(handle: ModelHandle | None = None) -> dict:
            if start is not None:
                start()
            model.handle.call("load_state_bytes", files, optimizer)
            loaded = {"op": "loaded", "model_id": model.model_id, "folder": folder}
            self.registry.calls.note({**loaded, "optimizer": optimizer})
            return {"path": path, "model_id": model.model_id, "type": "load_weights"}

        if start is not None:
            calls = self.registry.calls
            return calls.submit(namespace, "load_weights", model.worker, work), model.model_id
        return self.registry.run_on(model, "load_weights", work), model.model_id

    def _model_for_state(
        self, namespace: str | None, req: Any, record: dict, lora: LoraSettings, seed: int | None
    ) -> Model:
        """The new model a saved state loads into (``create_training_client_from_state``)."""
        if req.session_id is None or req.model_seq_id is None:
            raise ServiceError(400, "load_weights needs model_id, or session_id and model_seq_id")
        base = req.base_model or record["base_model"]
        if base != record["base_model"]:
            raise ServiceError(
                400, f"{req.path} was trained on {record['base_model']!r}, not {base!r}"
            )
        meta = req.user_metadata or {}
        return self.registry.new_model(
            namespace, req.session_id, req.model_seq_id, base, lora, meta, seed
        )

    # ------------------------------------------------------------------- restore

    def restore(self, model: Model, why: str, wanted: Collection[str] = ()) -> None:
        """Make ``model`` again where its placement starts models, from its history in the
        journal (``journal.py``): its last saved state, then each call since, in order. On
        the model's worker, before its next call; the answers of the calls in ``wanted``
        (future ids a restarted service replays) are kept for them (``Registry.run_on``).
        A model that cannot be made again is lost: its calls get a 410 naming why."""
        journal = self.registry.calls.journal
        assert journal is not None  # noqa: S101 - set only with a journal
        began = time.monotonic()
        placement = self.registry.placement
        orphan = None
        if model.restoring is not None:  # a restore its killed predecessor had begun
            orphan = placement.find_model(model.model_id, model.restoring)
        for old in (model.handle, orphan):  # what each held goes: a slot, a session run
            if old is not None:
                with contextlib.suppress(Exception):
                    old.close()
        model.handle = None
        say(f"model {model.model_id}: its weights were lost ({why}); making it again")
        generation = max(model.generation, model.restoring or 0) + 1
        note = {"model_id": model.model_id, "generation": generation}
        self.registry.calls.note({"op": "restoring", **note})
        model.restoring, last = generation, model.generation
        handle = None
        try:
            history = pending(journal.read()).history.get(model.model_id, [])
            if history and "/restore/" in history[0].get("folder", ""):
                model.restore_folder = history[0]["folder"]  # the service's own saved state
            model.generation = generation
            handle = placement.start_model(self.registry.spec(model))
            redone = {}
            for entry in history:
                out = self._redo(model, handle, entry)
                if entry.get("rid") in wanted:
                    redone[entry["rid"]] = out
        except Exception as err:
            model.generation = last
            if handle is not None:
                with contextlib.suppress(Exception):
                    handle.close()
            model.ended = f"lost: it could not be made again ({type(err).__name__}: {err})"[:500]
            say(f"model {model.model_id}: {model.ended}")
            raise ServiceError(410, f"model {model.model_id} is {model.ended}") from err
        self.registry.calls.note({"op": "restored", **note})
        model.redone, model.handle, model.restoring = redone, handle, None
        say(
            f"model {model.model_id} made again from its history ({len(history)} entries) in "
            f"{time.monotonic() - began:.1f} s"
        )

    def _redo(self, model: Model, handle: ModelHandle, entry: dict) -> Any:
        """One history entry, run again on a new model (unkeyed: it has none of the answers)."""
        op = entry["op"]
        if op == "loaded":
            files = self.checkpoints.read(entry["folder"], entry["optimizer"])
            return handle.call("load_state_bytes", files, entry["optimizer"])
        if op == "snap" and "folder" in entry:  # a saved sampler's weights
            data = self.checkpoints.storage.read_bytes(f"{entry['folder']}/adapter.safetensors")
            return handle.call("add_snapshot_bytes", entry["key"], data)
        if op == "snap":
            return handle.call("snapshot", entry["key"])
        raw = base64.b64decode(entry["body"])
        if entry["verb"] == "forward_backward":
            call = read_forward_backward(raw)
            custom = self._custom(model, call)
            args = (call.data, call.loss_fn, call.config, call.forward_only)
            return handle.call("forward_backward", *args, custom=custom)
        from tinker import types as t

        params = t.OptimStepRequest.model_validate(json.loads(raw)).optim_params
        return handle.call("optim_step", **adam_step(params))

    def bound_history(self, model: Model) -> None:
        """Past ``HISTORY_BYTES`` of history, save the model's state where its restore reads
        it (not a checkpoint of the client's), and start its history again from there."""
        if model.history_bytes <= HISTORY_BYTES or model.handle is None:
            return
        folder = f"{run_folder(model.namespace, model.model_id)}/restore/{secrets.token_hex(4)}"
        storage = self.checkpoints.storage
        work_for(None)
        for file, data in model.handle.call("state_bytes", True).items():
            storage.write_bytes(f"{folder}/{file}", data)
        self.registry.calls.note({"op": "saved", "model_id": model.model_id, "folder": folder})
        if model.restore_folder is not None:
            storage.delete(model.restore_folder)
        model.restore_folder, model.history_bytes = folder, 0
