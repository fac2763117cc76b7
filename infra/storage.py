"""Storage on any fsspec URL, and the checkpoint commit protocol on top of it.

`Storage("s3://bucket/prefix")` uses s3fs; with `AWS_ENDPOINT_URL` and credentials in the
environment it needs no options. A plain local path (or `file://`) is the default backend.

Checkpoint layout under `prefix`::

    step-00000012/<files...>      written first
    step-00000012/manifest.json   then: names, sizes, sha256, step, meta
    LATEST.json                   last: {"step": 12, "path": "step-00000012"}

A checkpoint is complete when its manifest exists and every file has its manifest size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import fsspec
from botocore.exceptions import ConnectionError as BotoConnectionError
from botocore.exceptions import HTTPClientError
from fsspec.exceptions import FSTimeoutError

log = logging.getLogger(__name__)
T = TypeVar("T")

# Errors worth retrying: the endpoint is down, slow, or dropped the connection. OSError covers
# aiohttp's connector errors, timeouts and S3 5xx (s3fs maps unknown codes to OSError).
TRANSIENT_ERRORS = (BotoConnectionError, HTTPClientError, FSTimeoutError, OSError)
PERMANENT_ERRORS = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError)


def is_transient(error: BaseException) -> bool:
    """Worth retrying: a connection/timeout error or a 5xx/408/429, not a wrong path or request."""
    if isinstance(error, PERMANENT_ERRORS) or not isinstance(error, TRANSIENT_ERRORS):
        return False
    response = getattr(error.__cause__, "response", None) or {}
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode", 500)
    return not (400 <= status < 500 and status not in (408, 429))


# Timeouts, measured with s3fs 2026.9 / aiobotocore 3.10 / aiohttp 3.14 against a SIGSTOPped moto:
# - `config_kwargs` connect_timeout / read_timeout (s3fs defaults 5 / 15 s) bound GETs, HEADs and
#   listings, but s3fs nests two 5-try retry loops around each call (botocore retries inside):
#   one read of a frozen endpoint took 15 x read_timeout. So botocore retries are off, the
#   instance's `S3FileSystem.retries` is 1, and `Storage._retry` owns the whole retry budget.
# - They do NOT bound uploads: botocore sends PUTs with "Expect: 100-continue", and aiohttp waits
#   for "100 Continue" (and drains a large body) with no timeout: a PUT to a frozen endpoint hung
#   forever. So every upload gets fsspec's per-call `timeout=` (asyncio.wait_for: the request is
#   cancelled) of `upload_timeout` + 1 s per MiB, and the FSTimeoutError is retried.
S3_CONFIG_DEFAULTS: dict[str, Any] = {
    "connect_timeout": 5,
    "read_timeout": 15,
    "retries": {"max_attempts": 1, "mode": "standard"},
}
UPLOAD_SECONDS_PER_MIB = 1.0


class Storage:
    """A root URL plus retried, relative-path file operations on it."""

    def __init__(
        self,
        url: str,
        storage_options: dict[str, Any] | None = None,
        retry_seconds: float = 60.0,
        upload_timeout: float = 60.0,
    ) -> None:
        """`retry_seconds`: total time to keep retrying transient errors (exponential backoff).
        `upload_timeout`: seconds one upload may take (+1 s per MiB) before it is retried.
        `storage_options` go to fsspec (for s3: `config_kwargs`, `client_kwargs`, `key`, ...).
        """
        self._args = (url, storage_options, retry_seconds, upload_timeout)
        if "://" not in url:
            url = Path(url).expanduser().resolve().as_uri()
        self.url = url.rstrip("/")
        self.retry_seconds = retry_seconds
        self.upload_timeout = upload_timeout
        protocol = self.url.split("://", 1)[0]
        options = dict(storage_options or {})
        if protocol in ("s3", "s3a"):
            options["config_kwargs"] = {**S3_CONFIG_DEFAULTS, **options.get("config_kwargs", {})}
        elif protocol == "file":
            options.setdefault("auto_mkdir", True)
        # Own instance: fsspec's instance cache ignores AWS_ENDPOINT_URL and similar env changes.
        options.setdefault("skip_instance_cache", True)
        self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        if protocol in ("s3", "s3a"):
            self.fs.retries = 1  # our own instance; see the note on S3_CONFIG_DEFAULTS
        self.is_local = protocol in ("file", "local")

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    def __reduce__(self) -> tuple[type[Storage], tuple]:
        return Storage, self._args  # rebuilt with our settings in a Ray worker or Prefect task

    def uri(self, *parts: str) -> str:
        """The full URL of `parts` joined under the root."""
        return "/".join([self.url, *(p.strip("/") for p in parts if p)])

    def _path(self, rel: str) -> str:
        return "/".join([self.root.rstrip("/"), rel.strip("/")]) if rel else self.root

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """Call `fn`, retrying transient errors with exponential backoff for `retry_seconds`.

        No new attempt starts after the budget, so the worst case is about `retry_seconds`
        plus one call's own timeout.
        """
        deadline = time.monotonic() + self.retry_seconds
        delay = 0.2
        while True:
            try:
                return fn()
            except TRANSIENT_ERRORS as error:
                if not is_transient(error) or time.monotonic() + delay > deadline:
                    raise
                log.warning("%s on %s failed (%r); retrying in %.1f s", what, self, error, delay)
                time.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _invalidate(self) -> None:
        # s3fs caches directory listings; another process may have written since.
        self.fs.invalidate_cache()

    def _timeout(self, nbytes: int) -> dict[str, float]:
        """fsspec's `timeout=` for one upload call (async filesystems only: local never hangs)."""
        if not getattr(self.fs, "async_impl", False):
            return {}
        return {"timeout": self.upload_timeout + nbytes / 2**20 * UPLOAD_SECONDS_PER_MIB}

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Write (or overwrite) one file; all or nothing is visible to readers."""
        self._write(rel, len(data), lambda path, **kw: self.fs.pipe_file(path, data, **kw))

    def write_file(self, rel: str, local: str | Path) -> None:
        """Write (or overwrite) one file from the local file ``local``, streamed (never whole
        in memory); all or nothing is visible to readers, as with ``write_bytes``."""
        size = os.path.getsize(local)
        self._write(rel, size, lambda path, **kw: self.fs.put_file(str(local), path, **kw))

    def _write(self, rel: str, nbytes: int, put: Callable[..., Any]) -> None:
        """``put(path, **options)`` retried; ``nbytes`` sizes a remote upload's timeout."""
        path = self._path(rel)
        if not self.is_local:
            timeout = self._timeout(nbytes)
            self._retry(f"write {rel}", lambda: put(path, **timeout))
            return
        # Locally a file is visible while being written, an S3 object only once complete:
        # write aside and rename so local readers also see all or nothing.
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        self._retry(f"write {rel}", lambda: put(tmp))
        os.replace(tmp, path)

    def read_bytes(self, rel: str) -> bytes:
        return self._retry(f"read {rel}", lambda: self.fs.cat_file(self._path(rel)))

    def read_file(self, rel: str, local: str | Path) -> None:
        """Download one file to the local path ``local``, streamed (never whole in memory)."""
        self._retry(f"read {rel}", lambda: self.fs.get_file(self._path(rel), str(local)))

    def write_json(self, rel: str, obj: Any) -> None:
        self.write_bytes(rel, json.dumps(obj, indent=2, sort_keys=True).encode())

    def read_json(self, rel: str) -> Any:
        return json.loads(self.read_bytes(rel))

    def exists(self, rel: str) -> bool:
        self._invalidate()
        return self._retry(f"exists {rel}", lambda: self.fs.exists(self._path(rel)))

    def list(self, rel: str = "") -> list[str]:
        """Sorted names (files and folders) directly below `rel`; [] if there is nothing."""
        self._invalidate()
        try:
            paths = self._retry(f"list {rel}", lambda: self.fs.ls(self._path(rel), detail=False))
        except FileNotFoundError:
            return []
        return sorted({p.rstrip("/").rsplit("/", 1)[-1] for p in paths})

    def sizes(self, rel: str = "") -> dict[str, int]:
        """Every file below `rel` (recursively), as relative path -> size in bytes."""
        self._invalidate()
        path = self._path(rel).rstrip("/")
        base = path + "/"
        found = self._retry(f"find {rel}", lambda: self.fs.find(path, detail=True))
        return {
            p[len(base) :]: int(info["size"]) for p, info in found.items() if p.startswith(base)
        }

    def put_dir(self, local_dir: str | Path, rel: str, exclude: tuple[str, ...] = ()) -> None:
        """Copy the tree under `local_dir` to `rel` (files are overwritten, none deleted),
        leaving out files named in `exclude`."""
        local_dir = Path(local_dir)
        sources = sorted(p for p in local_dir.rglob("*") if p.is_file() and p.name not in exclude)
        targets = [self._path(f"{rel}/{p.relative_to(local_dir).as_posix()}") for p in sources]
        timeout = self._timeout(sum(p.stat().st_size for p in sources))
        self._retry(
            f"put_dir {rel}", lambda: self.fs.put([str(p) for p in sources], targets, **timeout)
        )

    def get_dir(self, rel: str, local_dir: str | Path) -> None:
        """Copy the tree under `rel` into `local_dir`."""
        local_dir = Path(local_dir)
        names = list(self.sizes(rel))
        if not names:
            raise FileNotFoundError(self.uri(rel))
        targets = [local_dir / name for name in names]
        for target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
        sources = [self._path(f"{rel}/{name}") for name in names]
        self._retry(f"get_dir {rel}", lambda: self.fs.get(sources, [str(t) for t in targets]))

    def delete(self, rel: str) -> None:
        """Delete `rel` and everything below it; nothing to delete is not an error."""
        self._invalidate()
        path = self._path(rel)
        try:
            if self._retry(f"exists {rel}", lambda: self.fs.exists(path)):
                self._retry(f"delete {rel}", lambda: self.fs.rm(path, recursive=True))
        except FileNotFoundError:
            pass  # deleted meanwhile


# ---------------------------------------------------------------- checkpoint commit protocol

MANIFEST = "manifest.json"
POINTER = "LATEST.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or its bytes do not match its manifest."""


def checkpoint_dir(prefix: str, step: int) -> str:
    return f"{prefix.strip('/')}/step-{step:08d}"


def commit_checkpoint(
    storage: Storage, prefix: str, step: int, files: Mapping[str, bytes | Path], meta: dict
) -> str:
    """Write files, then the manifest, then LATEST.json; return the checkpoint's URI.

    A file is its bytes, or the ``Path`` of a local file holding them: that one is hashed and
    uploaded in chunks, so a large optimiser state is never a second copy in memory.
    Idempotent: committing the same step again overwrites it.
    """
    folder = checkpoint_dir(prefix, step)
    entries = {}
    for name, data in files.items():
        if isinstance(data, Path):
            storage.write_file(f"{folder}/{name}", data)
            entries[name] = {"size": data.stat().st_size, "sha256": _file_sha256(data)}
        else:
            storage.write_bytes(f"{folder}/{name}", data)
            entries[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    storage.write_json(f"{folder}/{MANIFEST}", {"step": step, "files": entries, "meta": meta})
    storage.write_json(f"{prefix.strip('/')}/{POINTER}", {"step": step, "path": f"step-{step:08d}"})
    return storage.uri(folder)


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _is_complete(storage: Storage, prefix: str, step: int) -> bool:
    """Manifest present and every listed file present with its manifest size (no hashing)."""
    folder = checkpoint_dir(prefix, step)
    try:
        manifest = storage.read_json(f"{folder}/{MANIFEST}")
        found = storage.sizes(folder)
    except (FileNotFoundError, ValueError):
        return False
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:  # a manifest listing nothing is no checkpoint
        return False
    try:
        return all(found.get(name) == entry["size"] for name, entry in files.items())
    except (KeyError, TypeError):
        return False


def _step_dirs(storage: Storage, prefix: str) -> list[int]:
    """Steps that have a folder under `prefix`, newest first (complete or not)."""
    steps = [_STEP_DIR.match(name) for name in storage.list(prefix)]
    return sorted((int(m.group(1)) for m in steps if m), reverse=True)


def latest_checkpoint(storage: Storage, prefix: str) -> int | None:
    """The step named by LATEST.json if complete, else the newest complete step, else None."""
    try:
        pointer = storage.read_json(f"{prefix.strip('/')}/{POINTER}")
        step = int(pointer["step"])
        if _is_complete(storage, prefix, step):
            return step
        log.warning("%s names step %d, which is incomplete; scanning", POINTER, step)
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        pass  # no pointer yet, or a torn/garbled one
    return next((s for s in _step_dirs(storage, prefix) if _is_complete(storage, prefix, s)), None)


def load_checkpoint(
    storage: Storage, prefix: str, step: int, into: Path | None = None
) -> tuple[dict[str, Any], dict]:
    """Read a checkpoint's (files, meta), verifying each file's size and sha256. A file is its
    bytes; with ``into`` (a local folder) it is downloaded there in chunks and is its ``Path``
    (a large optimiser state is then never whole in memory as bytes)."""
    folder = checkpoint_dir(prefix, step)
    try:
        manifest = storage.read_json(f"{folder}/{MANIFEST}")
    except FileNotFoundError as error:
        raise CheckpointError(f"no manifest at {storage.uri(folder)}: incomplete") from error
    files: dict[str, Any] = {}
    for name, entry in manifest["files"].items():
        rel = f"{folder}/{name}"
        try:
            if into is None:
                data: bytes | Path = storage.read_bytes(rel)
                size, digest = len(data), hashlib.sha256(data).hexdigest()
            else:
                data = _local_target(into, name, storage.uri(rel))
                storage.read_file(rel, data)
                size, digest = data.stat().st_size, _file_sha256(data)
        except FileNotFoundError as error:
            raise CheckpointError(f"{storage.uri(folder, name)} is missing") from error
        if size != entry["size"] or digest != entry["sha256"]:
            raise CheckpointError(
                f"{storage.uri(folder, name)} does not match its manifest: "
                f"size {size} vs {entry['size']}, sha256 {digest} vs {entry['sha256']}"
            )
        files[name] = data
    return files, manifest.get("meta", {})


def _local_target(into: Path, name: str, uri: str) -> Path:
    """Where the manifest's file ``name`` goes below ``into``: a name that would leave it (an
    absolute path, ``..``) is a corrupt manifest, never a path to write."""
    target = (into / name).resolve()
    if not target.is_relative_to(into.resolve()) or target == into.resolve():
        raise CheckpointError(f"{uri}: the manifest names a file outside its checkpoint")
    target.parent.mkdir(parents=True, exist_ok=True)
    return target


def prune_checkpoints(storage: Storage, prefix: str, keep: int) -> list[int]:
    """Delete complete checkpoints older than the newest `keep` (never the latest one).

    Incomplete folders are left alone (one may be a commit in progress). Returns deleted steps.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    latest = latest_checkpoint(storage, prefix)
    complete = [s for s in _step_dirs(storage, prefix) if _is_complete(storage, prefix, s)]
    doomed = [s for s in complete[keep:] if s != latest]
    for step in doomed:
        # Manifest first: an interrupted prune leaves a folder that reads as incomplete.
        storage.delete(f"{checkpoint_dir(prefix, step)}/{MANIFEST}")
        storage.delete(checkpoint_dir(prefix, step))
    return doomed


def load_latest_checkpoint(
    storage: Storage, prefix: str, into: Path | None = None
) -> tuple[int, dict[str, Any], dict] | None:
    """``(step, files, meta)`` of the newest intact checkpoint under ``prefix``, or None if there
    is none at all. Every file is verified against its manifest's sha256; a corrupt checkpoint
    (a flipped bit, a truncated file) is skipped with a warning naming it, and the next older
    complete one is tried. ``CheckpointError`` if checkpoints exist but none is intact. Files
    are bytes, or with ``into`` paths of their downloads there (``load_checkpoint``)."""
    latest = latest_checkpoint(storage, prefix)
    if latest is None:
        return None
    older = [s for s in _step_dirs(storage, prefix) if s != latest]
    corrupt: list[str] = []
    for step in [latest, *older]:
        if step != latest and not _is_complete(storage, prefix, step):
            continue
        try:
            return (step, *load_checkpoint(storage, prefix, step, into))
        except CheckpointError as error:
            log.warning("checkpoint step %d is corrupt, trying an older one: %s", step, error)
            corrupt.append(str(error))
    raise CheckpointError(
        "no intact checkpoint under " + storage.uri(prefix) + ": " + "; ".join(corrupt)
    )
