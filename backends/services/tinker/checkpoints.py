"""The Tinker service's runs and checkpoints in flowrl storage: a model's state saved as a
checkpoint (``save_state``, ``save_weights_for_sampler`` with a path), read back, listed and
deleted. Where each lives is ``backends.models.tinker_checkpoints``'s."""

from __future__ import annotations

import contextlib
import secrets
from datetime import UTC, datetime, timedelta
from typing import Any

from flowrl.backends.engines.tinker.types import tinker_lora_config
from flowrl.backends.models.tinker_checkpoints import (
    KINDS,
    NAME_PATTERN,
    checkpoint_folder,
    not_found,
    public_entry,
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

    def parse_path(
        self, namespace: str | None, path: Any, public: bool = False
    ) -> tuple[str, str, str]:
        """(run id, kind, storage folder) of the caller's checkpoint at ``path`` (with
        ``public``, also of another key's published one); an expired one is deleted and not
        found."""
        run_id, kind, folder = checkpoint_folder(self.storage, namespace, path, public)
        self._live(self.storage.read_json(f"{folder}/checkpoint.json"), folder)
        return run_id, kind, folder

    def _live(self, record: dict, folder: str) -> dict:
        """``record``, unless its TTL has passed: then its checkpoint is deleted (404)."""
        if _expired(record):
            self._remove(record, folder)
            expires = record["expires_at"]
            raise not_found(f"checkpoint {record.get('tinker_path')!r} expired at {expires}")
        return record

    def _remove(self, record: dict, folder: str) -> None:
        run_id, kind, name = record["tinker_path"][len("tinker://") :].split("/")
        self.storage.delete(public_entry(run_id, kind, name))
        self.storage.delete(folder)

    def save(
        self,
        model: Model,
        kind: str,
        name: str | None,
        optimizer: bool,
        meta: dict,
        ttl_seconds: int | None = None,
        overwrite: bool = True,
    ) -> str:
        """Queue a save of ``model`` as ``kind`` (weights | sampler_weights) named ``name``,
        expiring after ``ttl_seconds`` (None: never); without ``overwrite`` a name taken is a
        400 (a replay of the journal's own save is not refused)."""
        folder, path = self.new_folder(model, kind, name, ttl_seconds, overwrite)

        def work(handle: ModelHandle) -> dict:
            files = handle.call("state_bytes", optimizer)
            self.write(model, kind, folder, path, files, ttl_seconds, meta)
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

    def new_folder(
        self, model: Model, kind: str, name: str | None, ttl_seconds: Any, overwrite: bool
    ) -> tuple[str, str]:
        """The storage folder and ``tinker://`` path of ``model``'s checkpoint ``kind/name``
        (a name drawn if None), checked before the save is queued: the name, the TTL, and
        without ``overwrite`` a name taken (400: the SDK retries a 409 for minutes; a replay of
        the journal's own save is not refused)."""
        _expiry(ttl_seconds)
        if name is None:
            name = f"{'state' if kind == 'weights' else 'sampler'}-{secrets.token_hex(4)}"
        if not NAME_PATTERN.match(name):
            raise ServiceError(400, f"bad checkpoint name {name[:80]!r} (letters, digits, . _ -)")
        folder = f"{run_folder(model.namespace, model.model_id)}/{kind}/{name}"
        replaying = getattr(self.registry.calls.replaying, "replay", None) is not None
        if not overwrite and not replaying and self.storage.exists(f"{folder}/checkpoint.json"):
            raise ServiceError(
                400,
                f"checkpoint tinker://{model.model_id}/{kind}/{name} exists (overwrite=True "
                "replaces it)",
            )
        return folder, f"tinker://{model.model_id}/{kind}/{name}"

    def write(
        self,
        model: Model,
        kind: str,
        folder: str,
        path: str,
        files: dict[str, bytes],
        ttl_seconds: Any,
        meta: dict | None = None,
    ) -> int:
        """Write a checkpoint's ``files`` and its record; their size in bytes."""
        for file, data in files.items():
            self.storage.write_bytes(f"{folder}/{file}", data)
        size = sum(len(v) for v in files.values())
        record = {
            "checkpoint_id": f"{kind}/{path.rsplit('/', 1)[-1]}",
            "checkpoint_type": KINDS[kind],
            "time": now(),
            "tinker_path": path,
            "size_bytes": size,
            "user_metadata": {str(k): str(v) for k, v in (meta or {}).items()} or None,
            "base_model": model.base_model,
            "lora": tinker_lora_config(model.lora, model.seed),
            "public": False,
            "expires_at": _expiry(ttl_seconds),
        }
        self.storage.write_json(f"{folder}/checkpoint.json", record)
        return size

    def read(self, folder: str, optimizer: bool) -> dict[str, bytes]:
        """The files of the checkpoint in ``folder``: its adapter, and its optimizer state."""
        if not self.storage.exists(f"{folder}/adapter.safetensors"):
            raise ServiceError(
                400,
                "an external_weights checkpoint is for download: load a state or sampler weights",
            )
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
        for record, folder in self._records(run_dir):
            with contextlib.suppress(ServiceError):  # expired: deleted, not listed
                out.append(self._live(record, folder))
        return sorted(out, key=lambda c: c["time"])

    def _records(self, run_dir: str) -> list[tuple[dict, str]]:
        """Every checkpoint record of the run in ``run_dir``, with its folder."""
        out = []
        for kind in KINDS:
            base = f"{run_dir}/{kind}"
            if not self.storage.exists(base):
                continue
            for entry in self.storage.list(base):
                folder = f"{base}/{entry.rstrip('/').rsplit('/', 1)[-1]}"
                if self.storage.exists(f"{folder}/checkpoint.json"):
                    out.append((self.storage.read_json(f"{folder}/checkpoint.json"), folder))
        return out

    def run_record(self, namespace: str | None, run_id: str) -> dict:
        return self.storage.read_json(f"{run_folder(namespace, run_id)}/run.json")

    def delete(self, namespace: str | None, path: str) -> None:
        _, _, folder = self.parse_path(namespace, path)
        self._remove(self.record(folder), folder)

    def sweep(self) -> int:
        """Delete every expired checkpoint in storage, of every namespace; how many."""
        namespaces: list[str | None] = [None]
        if self.storage.exists("ns"):
            namespaces += [e.rstrip("/").rsplit("/", 1)[-1] for e in self.storage.list("ns")]
        deleted = 0
        for ns in namespaces:
            for run in self.runs(ns):
                for record, folder in self._records(run_folder(ns, run["training_run_id"])):
                    if _expired(record):
                        self._remove(record, folder)
                        deleted += 1
        return deleted

    def set_ttl(self, namespace: str | None, path: str, ttl_seconds: Any) -> None:
        """The caller's checkpoint at ``path`` expires ``ttl_seconds`` from now (None:
        never)."""
        _, _, folder = self.parse_path(namespace, path)
        record = self.record(folder)
        record["expires_at"] = _expiry(ttl_seconds)
        self.storage.write_json(f"{folder}/checkpoint.json", record)

    def publish(self, namespace: str | None, path: str, public: bool) -> None:
        """Publish (every key may sample it or load it into a model of its own) or unpublish
        the caller's checkpoint at ``path``."""
        run_id, kind, folder = self.parse_path(namespace, path)
        record = self.record(folder)
        record["public"] = public
        self.storage.write_json(f"{folder}/checkpoint.json", record)
        entry = public_entry(run_id, kind, folder.rsplit("/", 1)[-1])
        if public:
            self.storage.write_json(entry, {"namespace": namespace})
        else:
            self.storage.delete(entry)

    def copy(
        self, namespace: str | None, source: Any, run_id: str, project: str | None, ttl: Any
    ) -> str:
        """Copy the checkpoint at ``source`` (the caller's, or a published one) into a new run
        ``run_id`` of the caller's that holds only it (no model trains it; a training client
        may load it), in ``project``, expiring after ``ttl`` s (the source's expiry is not
        kept); its ``tinker://`` path."""
        _, kind, folder = self.parse_path(namespace, source, public=True)
        expires_at = _expiry(ttl)
        run_dir = run_folder(namespace, run_id)
        if self.storage.exists(f"{run_dir}/run.json"):
            raise ServiceError(400, f"training run {run_id} exists")
        name = folder.rsplit("/", 1)[-1]
        dest = f"{run_dir}/{kind}/{name}"
        for file in self.storage.list(folder):
            if file != "checkpoint.json":
                self.storage.write_bytes(
                    f"{dest}/{file}", self.storage.read_bytes(f"{folder}/{file}")
                )
        path = f"tinker://{run_id}/{kind}/{name}"
        record = self.record(folder) | {"tinker_path": path, "time": now(), "public": False}
        record |= {"expires_at": expires_at, "copied_from": source}
        self.storage.write_json(f"{dest}/checkpoint.json", record)
        run = self.storage.read_json(f"{folder.rsplit('/', 2)[0]}/run.json")
        run |= {"training_run_id": run_id, "model_owner": namespace or "local", "created": now()}
        run |= {"project_id": project, "copied_from": source, "trainable": False}
        self.storage.write_json(f"{run_dir}/run.json", run)
        return path

    def everything(self, namespace: str | None) -> list[dict]:
        """Every checkpoint of every run of the namespace."""
        out: list[dict] = []
        for run in self.runs(namespace):
            out += self.of_run(namespace, run["training_run_id"])
        return out


MIN_TTL_S = 3600
MAX_TTL_S = 10 * 365 * 86400


def _expired(record: dict) -> bool:
    expires = record.get("expires_at")
    return bool(expires) and datetime.fromisoformat(expires) <= datetime.now(UTC)


def _expiry(ttl_seconds: Any) -> str | None:
    """When a checkpoint with ``ttl_seconds`` expires (ISO time; None: never); a TTL outside
    1 hour .. 10 years is a 400, as the SDK documents."""
    if ttl_seconds is None:
        return None
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int):
        raise ServiceError(400, f"ttl_seconds must be a whole number, got {ttl_seconds!r}"[:200])
    if not MIN_TTL_S <= ttl_seconds <= MAX_TTL_S:
        raise ServiceError(
            400,
            f"ttl_seconds must be {MIN_TTL_S} (1 hour) to {MAX_TTL_S} (10 years), got "
            f"{ttl_seconds}",
        )
    return (datetime.now(UTC) + timedelta(seconds=ttl_seconds)).isoformat()


CHECKPOINT_FIELDS = (
    "checkpoint_id",
    "checkpoint_type",
    "time",
    "tinker_path",
    "size_bytes",
    "user_metadata",
    "public",
    "expires_at",
)


def checkpoint_view(c: dict | None) -> dict | None:
    """A checkpoint's record as the SDK's ``Checkpoint`` reads it."""
    return None if c is None else {k: c.get(k) for k in CHECKPOINT_FIELDS}


def run_view(run: dict, checkpoints: list[dict]) -> dict:
    """A run's record and its last checkpoints, as the SDK's ``TrainingRun`` reads them."""
    last: dict[str, dict | None] = {"training": None, "sampler": None}
    for c in checkpoints:
        last[c["checkpoint_type"]] = c
    return {
        "training_run_id": run["training_run_id"],
        "base_model": run["base_model"],
        "model_owner": run["model_owner"],
        "is_lora": True,
        "lora_rank": run["lora"]["rank"],
        "last_request_time": run["created"],
        "last_checkpoint": checkpoint_view(last["training"]),
        "last_sampler_checkpoint": checkpoint_view(last["sampler"]),
        "user_metadata": run.get("user_metadata") or None,
    }
