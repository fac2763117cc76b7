"""The Tinker service's training verbs on a model: ``forward_backward`` (and ``forward``),
``optim_step``, and loading a saved state into a live or a new model. Each runs on the model's
worker (``Registry.run_on``) and answers a future id at once."""

from __future__ import annotations

from typing import Any

from flowrl.backends.engines.tinker.types import check_batch, read_tinker_lora
from flowrl.backends.policy.tinker_handles import ModelHandle
from flowrl.backends.services.tinker.checkpoints import Checkpoints
from flowrl.backends.services.tinker.registry import Registry
from flowrl.backends.services.tinker.state import Model
from flowrl.backends.services.tinker.wire import write_forward_output
from flowrl.backends.types import LoraSettings
from flowrl.infra.serving import ServiceError


class Training:
    """The verbs that change or read a training model's weights."""

    def __init__(self, registry: Registry, checkpoints: Checkpoints):
        self.registry = registry
        self.checkpoints = checkpoints

    def forward_backward(self, namespace: str | None, call: Any) -> tuple[str, str]:
        """A decoded ``forward_backward`` / ``forward`` call, checked against the model's
        vocabulary when it is up (and by the model again, once it is); (future id, model id)."""
        model = self.registry.model(namespace, call.model_id)
        if model.handle is not None:
            check_batch(call.data, call.loss_fn, call.config, model.handle.info["vocab_size"])

        def work(handle: ModelHandle) -> bytes:
            out = handle.call(
                "forward_backward", call.data, call.loss_fn, call.config, call.forward_only
            )
            return write_forward_output(out)

        return self.registry.run_on(model, "forward_backward", work), model.model_id

    def optim_step(self, namespace: str | None, model_id: Any, adam: dict) -> tuple[str, str]:
        """One AdamW step with checked parameters (``types.adam_step``)."""
        model = self.registry.model(namespace, model_id)

        def work(handle: ModelHandle) -> dict:
            return {"metrics": handle.call("optim_step", **adam)}

        return self.registry.run_on(model, "optim_step", work), model.model_id

    def load_weights(self, namespace: str | None, req: Any) -> tuple[str, str]:
        """A ``LoadWeightsRequest``: a saved state into a live model of the same base and
        adapter shape (``model_id``), or into a new model (``session_id`` + ``model_seq_id``)."""
        _, kind, folder = self.checkpoints.parse_path(namespace, req.path)
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
