"""The Tinker service's runs and checkpoints in flowrl storage: a model's state saved as a
checkpoint (``save_state``, ``save_weights_for_sampler`` with a path), read back, listed and
deleted. Where each lives is ``backends.models.tinker_checkpoints``'s."""

from __future__ import annotations

import secrets
from typing import Any

from flowrl.backends.engines.tinker.types import tinker_lora_config
from flowrl.backends.models.tinker_checkpoints import (
    KINDS,
    NAME_PATTERN,
    checkpoint_folder,
    not_found,
    run_folder,
    tinker_prefix,
)
from flowrl.backends.policy.tinker_handles import ModelHandle
from flowrl.backends.services.tinker.registry import Registry
from flowrl.backends.services.tinker.state import Model, now
from flowrl.infra.serving import ServiceError
from flowrl.infra.storage import Storage


class Checkpoints:
    """Runs (one per training model: ``run.json``) and their checkpoints, each namespace's
    under its own prefix."""

    def __init__(self, storage: Storage, registry: Registry):
        self.storage = storage
        self.registry = registry

    def parse_path(self, namespace: str | None, path: Any) -> tuple[str, str, str]:
        """(run id, kind, storage folder) of the caller's checkpoint at ``path``."""
        return checkpoint_folder(self.storage, namespace, path)

    def save(self, model: Model, kind: str, name: str | None, optimizer: bool, meta: dict) -> str:
        """Queue a save of ``model`` as ``kind`` (weights | sampler_weights) named ``name``."""
        if name is None:
            name = f"{'state' if kind == 'weights' else 'sampler'}-{secrets.token_hex(4)}"
        if not NAME_PATTERN.match(name):
            raise ServiceError(400, f"bad checkpoint name {name[:80]!r} (letters, digits, . _ -)")
        folder = f"{run_folder(model.namespace, model.model_id)}/{kind}/{name}"
        path = f"tinker://{model.model_id}/{kind}/{name}"
        storage = self.storage

        def work(handle: ModelHandle) -> dict:
            files = handle.call("state_bytes", optimizer)
            for file, data in files.items():
                storage.write_bytes(f"{folder}/{file}", data)
            record = {
                "checkpoint_id": f"{kind}/{name}",
                "checkpoint_type": KINDS[kind],
                "time": now(),
                "tinker_path": path,
                "size_bytes": sum(len(v) for v in files.values()),
                "user_metadata": {str(k): str(v) for k, v in (meta or {}).items()} or None,
                "base_model": model.base_model,
                "lora": tinker_lora_config(model.lora, model.seed),
            }
            storage.write_json(f"{folder}/checkpoint.json", record)
            if kind == "sampler_weights":
                handle.call("add_snapshot_bytes", path, files["adapter.safetensors"])
                snap = {"op": "snap", "model_id": model.model_id, "key": path, "folder": folder}
                self.registry.calls.note(snap)  # the model's history (``journal.py``)
            else:  # a saved state: the model's history starts again from it
                self.registry.calls.note(
                    {"op": "saved", "model_id": model.model_id, "folder": folder}
                )
            return {
                "path": path,
                "type": "save_weights" if kind == "weights" else "save_weights_for_sampler",
            }

        return self.registry.run_on(model, "save", work)

    def read(self, folder: str, optimizer: bool) -> dict[str, bytes]:
        """The files of the checkpoint in ``folder``: its adapter, and its optimizer state."""
        files = {"adapter.safetensors": self.storage.read_bytes(f"{folder}/adapter.safetensors")}
        if optimizer:
            if not self.storage.exists(f"{folder}/optimizer.pt"):
                raise ServiceError(400, "this checkpoint has no optimizer state")
            files["optimizer.pt"] = self.storage.read_bytes(f"{folder}/optimizer.pt")
        return files

    def record(self, folder: str) -> dict:
        return self.storage.read_json(f"{folder}/checkpoint.json")

    def runs(self, namespace: str | None) -> list[dict]:
        prefix = tinker_prefix(namespace)
        out = []
        for entry in self.storage.list(prefix) if self.storage.exists(prefix) else []:
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if self.storage.exists(f"{prefix}/{name}/run.json"):
                out.append(self.storage.read_json(f"{prefix}/{name}/run.json"))
        return sorted(out, key=lambda r: r.get("created", ""), reverse=True)

    def of_run(self, namespace: str | None, run_id: str) -> list[dict]:
        """The checkpoints of one run, oldest first."""
        run_dir = run_folder(namespace, run_id)
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

    def run_record(self, namespace: str | None, run_id: str) -> dict:
        return self.storage.read_json(f"{run_folder(namespace, run_id)}/run.json")

    def delete(self, namespace: str | None, path: str) -> None:
        _, _, folder = self.parse_path(namespace, path)
        self.storage.delete(folder)

    def everything(self, namespace: str | None) -> list[dict]:
        """Every checkpoint of every run of the namespace."""
        out: list[dict] = []
        for run in self.runs(namespace):
            out += self.of_run(namespace, run["training_run_id"])
        return out
