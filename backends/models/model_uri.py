"""Model URIs as local folders: a local path, any fsspec URL (``s3://`` ...) or a version in the
MLflow model registry (``models:/name@alias``) becomes a Hugging Face folder on local disk,
copied once into a model cache; tiny models (``model.source: tiny``) are built into that cache.

Also: pinning a registry alias to the version it names now (``pin_model_uri``) and checking a
source before a job starts (``check_model_source``). ``flowrl.backends.models.model_folder`` reads
the folder. Nothing here touches a model hub.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from flowrl.backends.models.tiny_model import TinyModelSpec, build_tiny_model

_MLFLOW_SCHEMES = ("models:/", "runs:/")
_COMPLETE_MARKER = ".flowrl-complete"
CACHE_BOOKKEEPING = (_COMPLETE_MARKER,)
"""Files the model cache adds to a model folder (left out when a cached model is copied)."""


def resolve_model_uri(uri: str, cache_dir: str) -> str:
    """Return a local HF model folder (the one holding ``config.json``) for ``uri``.

    - a local path or ``file://`` URL: used in place;
    - ``models:/name@alias``, ``models:/name/version``, ``runs:/...``: downloaded from MLflow
      into ``cache_dir`` (an alias is resolved to its version first, so a moved alias is seen);
    - any other fsspec URL (``s3://`` ...): copied into ``cache_dir`` once, keyed by a hash of
      the URI (a copy is reused only when it completed).

    The folder may be the URI itself or nested one level below it (in an MLflow Model: below
    its ``artifacts/``, see ``backends.models.mlflow_model``). Raises
    ``FileNotFoundError`` (nothing there) or ``ValueError`` (unknown scheme) naming the URI.
    """
    if uri.startswith(_MLFLOW_SCHEMES):
        return _find_model_folder(_download_mlflow(uri, Path(cache_dir)), uri)
    if uri.startswith("file://") or "://" not in uri:
        local = Path(uri.removeprefix("file://")).expanduser()
        if not local.is_dir():
            raise FileNotFoundError(f"no model folder at {uri!r} ({local} is not a directory)")
        return _find_model_folder(local, uri)
    return _find_model_folder(_download_fsspec(uri, Path(cache_dir)), uri)


def check_model_source(uri: str) -> None:
    """Fail fast, before a job starts, when ``model.source`` cannot be a model: a local folder
    that is missing, unreadable or holds no ``config.json``; a registry name, version or alias
    that does not exist; an fsspec URL with no ``config.json``. ``"tiny"`` is always fine.
    Raises ``ValueError`` naming the source and what is wrong."""
    if uri == "tiny":
        return
    try:
        if uri.startswith(_MLFLOW_SCHEMES):
            pinned = _pin_registry_version(uri)
            if pinned is not None:
                from flowrl.infra.tracking import client

                name, _, version = pinned.removeprefix("models:/").rpartition("/")
                client().get_model_version(name, version)
            return
        if uri.startswith("file://") or "://" not in uri:
            local = Path(uri.removeprefix("file://")).expanduser()
            if not local.is_dir():
                raise ValueError("no such folder")
            if not os.access(local, os.R_OK | os.X_OK):
                raise ValueError("the folder is not readable")
            _find_model_folder(local, uri)
            return
        import fsspec

        fs, root = fsspec.core.url_to_fs(uri, skip_instance_cache=True)
        if not (fs.exists(f"{root.rstrip('/')}/config.json") or fs.glob(f"{root}/*/config.json")):
            raise ValueError("no config.json there or one level below")
    except ValueError as err:
        raise ValueError(f"model.source {uri!r}: {err}") from None
    except Exception as err:  # registry or storage said no: name it, without a traceback
        raise ValueError(f"model.source {uri!r}: {type(err).__name__}: {err}") from None


def _cache_slot(cache_dir: Path, key: str) -> Path:
    return cache_dir / hashlib.sha256(key.encode()).hexdigest()[:16]


def tiny_model_key(spec: TinyModelSpec) -> str:
    """The cache key of a tiny model's shape (a text model's leaves its disabled vision section
    out): the same for a job's model and the Tinker API's ``tiny``, so both use one build."""
    shape = spec.model_dump(exclude=None if spec.vision.enabled else {"vision"})
    blob = json.dumps([shape], sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def tiny_model_slot(cache_dir: str, key: str) -> Path:
    """Where ``cached_tiny_model`` keeps the tiny model whose spec hashes to ``key``."""
    return Path(cache_dir) / f"tiny-{key}"


def cached_tiny_model(slot: Path) -> Path | None:
    """The complete tiny model at ``slot``, or None when it has not been built there."""
    return slot if _complete(slot) else None


def _complete(slot: Path) -> bool:
    """A cache slot holds a whole copy (``_fill_once`` marks it last)."""
    return (slot / _COMPLETE_MARKER).exists()


def build_tiny_model_once(spec: TinyModelSpec, slot: Path) -> Path:
    """``build_tiny_model(spec)`` into ``slot`` of a model cache, unless a complete build is
    there (it is the same: the weights depend only on the spec). Two processes building the
    same slot at once both finish, and one build is kept."""
    return _fill_once(slot, lambda tmp: build_tiny_model(spec, str(tmp)))


def _fill_once(slot: Path, fill: Any) -> Path:
    """Run ``fill(tmp_dir)`` and move the result to ``slot``, unless a complete copy is there."""
    if _complete(slot):
        return slot
    slot.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=slot.parent, prefix=f".{slot.name}-"))
    try:
        fill(tmp)
        (tmp / _COMPLETE_MARKER).touch()
        try:
            tmp.rename(slot)  # atomic; fails if another process's complete copy is there
        except OSError:
            if _complete(slot):
                return slot  # another job filled it first, and may be reading it: keep theirs
            shutil.rmtree(slot, ignore_errors=True)  # an incomplete leftover
            tmp.rename(slot)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return slot


def _download_fsspec(uri: str, cache_dir: Path) -> Path:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(uri, skip_instance_cache=True)
    except (ValueError, ImportError) as err:
        raise ValueError(f"cannot open model URI {uri!r}: {err}") from err
    if not fs.isdir(root):
        raise FileNotFoundError(f"no model folder at {uri!r}")
    root = root.rstrip("/")
    listing = fs.find(root, detail=True)

    def fill(tmp: Path) -> None:
        # find() + get_file() per file avoids fsspec's trailing-slash rules for recursive get.
        for remote in listing:
            relative = remote[len(root) :].lstrip("/")
            target = tmp / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(remote, str(target))

    # Keyed by the URI and what is there now: a model written again at the same URI is copied
    # again, never served stale from the cache (which every home on a machine may share).
    version = sorted(
        (name, info.get("size"), _file_version(info)) for name, info in listing.items()
    )
    return _fill_once(_cache_slot(cache_dir, json.dumps([uri, version], default=str)), fill)


def _file_version(info: dict[str, Any]) -> Any:
    """What changes when a file is written again, from an fsspec listing entry (S3's ETag,
    else a modification time)."""
    for key in ("ETag", "etag", "LastModified", "last_modified", "mtime", "updated", "created"):
        if info.get(key) is not None:
            return info[key]
    return None


def _download_mlflow(uri: str, cache_dir: Path) -> Path:
    import mlflow
    from mlflow.exceptions import MlflowException

    pinned = _pin_registry_version(uri)
    key = f"{mlflow.get_registry_uri()}|{pinned or uri}"

    def fill(tmp: Path) -> None:
        try:
            mlflow.artifacts.download_artifacts(artifact_uri=pinned or uri, dst_path=str(tmp))
        except MlflowException as err:
            raise FileNotFoundError(f"cannot download model {uri!r} from MLflow: {err}") from err

    slot = _cache_slot(cache_dir, key)
    if pinned is None:  # e.g. models:/name/latest or runs:/ : may change, always fetch again
        shutil.rmtree(slot, ignore_errors=True)
    return _fill_once(slot, fill)


def pin_model_uri(uri: str) -> str:
    """``models:/name@alias`` -> the version the alias names now (``models:/name/7``); any other
    URI unchanged. A job pins its base model once, so that moving ``champion`` while it runs (or
    between two jobs) never mixes versions, and caches keyed by the URI stay correct."""
    return _pin_registry_version(uri) or uri


def _pin_registry_version(uri: str) -> str | None:
    """``models:/name@alias`` -> ``models:/name/<version>``; a numbered version stays; else None."""
    if not uri.startswith("models:/"):
        return None
    ref = uri.removeprefix("models:/").strip("/")
    if "@" in ref:
        from flowrl.infra.tracking import alias_version

        name, alias = ref.rsplit("@", 1)
        version = alias_version(name, alias)
        if version is None:
            raise FileNotFoundError(f"no registered model version for {uri!r}")
        return f"models:/{name}/{version}"
    name, _, version = ref.rpartition("/")
    return uri if name and version.isdigit() else None


def _find_model_folder(root: Path, uri: str) -> str:
    if (root / "config.json").is_file():
        return str(root)
    if (root / "MLmodel").is_file():  # a registered flowrl version: the pyfunc's HF artifact
        root = root / "artifacts"
    nested = sorted(p.parent for p in root.glob("*/config.json"))
    if len(nested) == 1:
        return str(nested[0])
    if nested:
        names = [p.name for p in nested]
        raise ValueError(f"model URI {uri!r} holds several model folders: {names}")
    raise FileNotFoundError(f"no config.json at {uri!r} or one level below it")
