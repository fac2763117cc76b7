"""Where the Tinker API keeps runs and checkpoints, and where its base models come from.

A namespace's runs live under ``ns/<namespace>/tinker/`` of flowrl storage (``tinker/`` without
a namespace); a run is ``<session>-train-<n>``, and a checkpoint ``tinker://<run>/<kind>/<name>``
is the folder ``<run folder>/<kind>/<name>/`` (``adapter.safetensors``, ``optimizer.pt`` for
``weights``, ``checkpoint.json``). Paths are parsed here, for the service, the registration of a
checkpoint as an MLflow Model and the command line alike: none of them needs FastAPI to resolve
one.
"""

from __future__ import annotations

import re
from typing import Any

from flowrl.infra.serving import ServiceError
from flowrl.infra.storage import Storage

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
RUN_PATTERN = re.compile(r"^([0-9a-f]{16}):train:([0-9]{1,6})$")
KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}
"""Checkpoint kinds in a ``tinker://`` path → the SDK's ``checkpoint_type``."""


def not_found(what: str) -> ServiceError:
    return ServiceError(404, what)


def tinker_prefix(namespace: str | None) -> str:
    """A namespace's Tinker runs in storage: ``ns/<namespace>/tinker`` (``tinker`` without)."""
    return f"ns/{namespace}/tinker" if namespace else "tinker"


def run_folder(namespace: str | None, run_id: str) -> str:
    """A training run's storage folder: ``[ns/<namespace>/]tinker/<session>-train-<n>``."""
    match = RUN_PATTERN.match(run_id)
    if not match:
        raise not_found(f"no training run {run_id[:80]!r}")
    return f"{tinker_prefix(namespace)}/{match[1]}-train-{match[2]}"


def public_entry(run_id: str, kind: str, name: str) -> str:
    """Where the index of published checkpoints names a public checkpoint's owner."""
    return f"tinker/public/{run_id}/{kind}/{name}.json"


def checkpoint_folder(
    storage: Storage, namespace: str | None, path: Any, public: bool = False
) -> tuple[str, str, str]:
    """``tinker://<run>/<kind>/<name>`` → (run id, kind, storage folder). The run must be
    ``namespace``'s (or, with ``public``, a published checkpoint of another's) and the
    checkpoint must exist (``ServiceError`` 400 / 404 naming it)."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise ServiceError(400, f"not a tinker:// path: {str(path)[:120]!r}")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not NAME_PATTERN.match(parts[2]):
        raise ServiceError(
            400,
            "a path is tinker://<run>/weights|sampler_weights|external_weights/<name>: "
            f"{path[:120]!r}",
        )
    run_id, kind, name = parts
    folder = f"{run_folder(namespace, run_id)}/{kind}/{name}"
    if public and not storage.exists(f"{folder}/checkpoint.json"):
        entry = public_entry(run_id, kind, name)
        if storage.exists(entry):
            owner = storage.read_json(entry).get("namespace")
            folder = f"{run_folder(owner, run_id)}/{kind}/{name}"
    if not storage.exists(f"{folder}/checkpoint.json"):
        raise not_found(f"no checkpoint {path!r}")
    return run_id, kind, folder


def resolve_base_model(uri: str, cache_dir: str) -> str:
    """A catalogue URI as a local folder: ``tiny`` (the default tiny model, built once into
    the model cache), a local folder, ``s3://`` or ``models:/``. (The model code is imported
    here, not with the module: a path never costs a process torch.)"""
    from flowrl.backends.models.model_uri import (
        build_tiny_model_once,
        resolve_model_uri,
        tiny_model_key,
        tiny_model_slot,
    )
    from flowrl.backends.models.tiny_model import TinyModelSpec

    if uri == "tiny":  # the build a job of the default tiny model uses too
        spec = TinyModelSpec()
        return str(build_tiny_model_once(spec, tiny_model_slot(cache_dir, tiny_model_key(spec))))
    return resolve_model_uri(uri, cache_dir)
