"""Storage and the checkpoint commit protocol, on a local folder and on moto's S3 endpoint."""

from __future__ import annotations

import hashlib
import json
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from faults import OutageProxy

from flowrl.infra.storage import (
    CheckpointError,
    Storage,
    checkpoint_dir,
    commit_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    load_latest_checkpoint,
    prune_checkpoints,
)

# Short timeouts so outage tests finish in seconds (production defaults: 5 / 15 / 60 s).
FAST_S3 = {"config_kwargs": {"connect_timeout": 1, "read_timeout": 1}}
PREFIX = "jobs/job-1/checkpoints"


def checkpoint_files(step: int) -> dict[str, bytes]:
    return {
        "model.safetensors": bytes([step % 256]) * (1000 + step),
        "optimizer/state.pt": f"optimizer state at step {step}".encode(),
    }


@pytest.fixture(params=["local", "s3"])
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> Storage:
    if request.param == "local":
        return Storage(str(tmp_path / "store"), retry_seconds=5)
    moto_s3 = request.getfixturevalue("moto_s3")
    return Storage(
        f"{moto_s3.url}/root", storage_options=FAST_S3, retry_seconds=5, upload_timeout=2
    )


# ---------------------------------------------------------------------------- Storage


def test_uri_is_absolute_url_under_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    local = Storage("store")
    assert local.uri("a", "b.json") == f"file://{tmp_path.resolve()}/store/a/b.json"
    assert Storage("s3://bucket/root/").uri("step-00000001/", "x") == (
        "s3://bucket/root/step-00000001/x"
    )


def test_write_read_exists_list(storage: Storage) -> None:
    storage.write_bytes("a/blob.bin", b"\x00\x01payload")
    storage.write_json("a/meta.json", {"step": 3, "loss": 0.5})
    storage.write_bytes("a/sub/deep.txt", b"deep")

    assert storage.read_bytes("a/blob.bin") == b"\x00\x01payload"
    assert storage.read_json("a/meta.json") == {"step": 3, "loss": 0.5}
    assert storage.exists("a/blob.bin") and storage.exists("a/sub")
    assert not storage.exists("a/missing.bin")
    # Names directly below, folders included; no temporary files left behind.
    assert storage.list("a") == ["blob.bin", "meta.json", "sub"]
    assert storage.list("nothing/here") == []
    meta_size = len(storage.read_bytes("a/meta.json"))
    assert storage.sizes("a") == {"blob.bin": 9, "meta.json": meta_size, "sub/deep.txt": 4}


def test_pickled_storage_reaches_the_same_files(storage: Storage) -> None:
    storage.write_bytes("shared.bin", b"from the driver")
    copy = pickle.loads(pickle.dumps(storage))
    assert copy.url == storage.url and copy.retry_seconds == storage.retry_seconds
    assert copy.read_bytes("shared.bin") == b"from the driver"


def test_read_missing_fails_at_once(storage: Storage, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(FileNotFoundError):
        storage.read_bytes("missing.bin")
    assert "retrying" not in caplog.text, "a missing file is not a transient error"


def test_overwrite_replaces_content(storage: Storage) -> None:
    storage.write_bytes("x.bin", b"first version, long")
    storage.write_bytes("x.bin", b"second")
    assert storage.read_bytes("x.bin") == b"second"


def test_put_dir_get_dir_roundtrip(storage: Storage, tmp_path: Path) -> None:
    source = tmp_path / "model"
    (source / "tokenizer").mkdir(parents=True)
    (source / "config.json").write_text('{"hidden": 128}')
    (source / "tokenizer" / "vocab.json").write_text('{"a": 0}')
    (source / "weights.bin").write_bytes(bytes(range(256)) * 64)

    storage.put_dir(source, "models/tiny")
    assert storage.list("models/tiny") == ["config.json", "tokenizer", "weights.bin"]

    target = tmp_path / "downloaded"
    storage.get_dir("models/tiny", target)
    copied = sorted(p.relative_to(target).as_posix() for p in target.rglob("*") if p.is_file())
    assert copied == ["config.json", "tokenizer/vocab.json", "weights.bin"]
    for name in copied:
        assert (target / name).read_bytes() == (source / name).read_bytes()


def test_delete_is_recursive_and_idempotent(storage: Storage) -> None:
    storage.write_bytes("run/a.bin", b"a")
    storage.write_bytes("run/nested/b.bin", b"b")
    storage.write_bytes("keep.bin", b"k")
    storage.delete("run")
    assert not storage.exists("run/nested/b.bin")
    assert storage.list("") == ["keep.bin"]
    storage.delete("run")  # nothing left: no error


# ---------------------------------------------------------------------------- checkpoints


def test_empty_prefix_has_no_checkpoint(storage: Storage) -> None:
    assert latest_checkpoint(storage, PREFIX) is None


def test_commit_then_latest_and_load(storage: Storage) -> None:
    commit_checkpoint(storage, PREFIX, 1, checkpoint_files(1), {"reward": 0.1})
    uri = commit_checkpoint(storage, PREFIX, 2, checkpoint_files(2), {"reward": 0.3})

    assert uri == storage.uri(PREFIX, "step-00000002")
    assert storage.read_json(f"{PREFIX}/LATEST.json") == {"step": 2, "path": "step-00000002"}
    manifest = storage.read_json(f"{PREFIX}/step-00000002/manifest.json")
    weights = checkpoint_files(2)["model.safetensors"]
    assert manifest["files"]["model.safetensors"] == {
        "size": len(weights),
        "sha256": hashlib.sha256(weights).hexdigest(),
    }
    assert latest_checkpoint(storage, PREFIX) == 2
    assert load_checkpoint(storage, PREFIX, 2) == (checkpoint_files(2), {"reward": 0.3})
    assert load_checkpoint(storage, PREFIX, 1) == (checkpoint_files(1), {"reward": 0.1})


def test_a_checkpoint_committed_from_local_files_reads_back_as_committed_from_bytes(
    storage: Storage, tmp_path: Path
) -> None:
    """A trainer writes its large files (the optimiser's state) to a local folder and commits
    their paths: the upload streams them, and the checkpoint is the one their bytes make."""
    # 10 MB: a multipart upload on S3, hashed from the file in chunks
    files = checkpoint_files(3) | {"big.pt": bytes(range(256)) * 40_000}
    local = tmp_path / "staged"
    local.mkdir()
    paths = {}
    for name, data in files.items():
        paths[name] = local / name.replace("/", "_")
        paths[name].write_bytes(data)

    commit_checkpoint(storage, PREFIX, 3, paths, {"reward": 0.5})
    commit_checkpoint(storage, PREFIX, 4, files, {"reward": 0.5})

    assert load_latest_checkpoint(storage, PREFIX) == (4, files, {"reward": 0.5})
    assert load_checkpoint(storage, PREFIX, 3) == (files, {"reward": 0.5})
    manifests = [storage.read_json(f"{checkpoint_dir(PREFIX, s)}/manifest.json") for s in (3, 4)]
    assert manifests[0]["files"] == manifests[1]["files"]
    assert storage.list(checkpoint_dir(PREFIX, 3)) == storage.list(checkpoint_dir(PREFIX, 4))


def test_a_manifest_naming_a_file_outside_its_checkpoint_writes_nothing_there(
    storage: Storage, tmp_path: Path
) -> None:
    """A checkpoint's manifest is data: loading into a local folder never follows a name out
    of it, and the checkpoint reads as corrupt (the next older intact one is loaded)."""
    commit_checkpoint(storage, PREFIX, 1, checkpoint_files(1), {})
    folder = checkpoint_dir(PREFIX, 2)
    storage.write_bytes(f"{folder}/x.pt", b"hostile")
    entry = {"size": 7, "sha256": hashlib.sha256(b"hostile").hexdigest()}
    manifest = {"step": 2, "files": {"../../escaped.pt": entry}, "meta": {}}
    storage.write_json(f"{folder}/manifest.json", manifest)
    storage.write_json(f"{PREFIX}/LATEST.json", {"step": 2, "path": "step-00000002"})
    into = tmp_path / "a" / "b" / "into"
    into.mkdir(parents=True)

    with pytest.raises(CheckpointError, match="outside its checkpoint"):
        load_checkpoint(storage, PREFIX, 2, into=into)
    step, files, _ = load_latest_checkpoint(storage, PREFIX, into=into)

    assert step == 1 and {n: p.read_bytes() for n, p in files.items()} == checkpoint_files(1)
    assert all(p.is_relative_to(into) for p in files.values())
    assert not (tmp_path / "a" / "escaped.pt").exists()


def files_without_manifest(storage: Storage) -> None:
    """Crash after the files of step 2, before its manifest (and its pointer)."""
    for name, data in checkpoint_files(2).items():
        storage.write_bytes(f"{checkpoint_dir(PREFIX, 2)}/{name}", data)
    storage.delete(f"{PREFIX}/LATEST.json")  # force the scan, not just the pointer


def truncated_file_under_pointer(storage: Storage) -> None:
    """Step 2 fully committed, then one of its files is cut short."""
    commit_checkpoint(storage, PREFIX, 2, checkpoint_files(2), {})
    storage.write_bytes(f"{checkpoint_dir(PREFIX, 2)}/model.safetensors", b"\x02" * 10)


def pointer_to_missing_step(storage: Storage) -> None:
    storage.write_json(f"{PREFIX}/LATEST.json", {"step": 7, "path": "step-00000007"})


def torn_pointer(storage: Storage) -> None:
    storage.write_bytes(f"{PREFIX}/LATEST.json", b'{"st')


@pytest.mark.parametrize(
    "break_step_2",
    [files_without_manifest, truncated_file_under_pointer, pointer_to_missing_step, torn_pointer],
)
def test_half_written_checkpoint_is_never_latest(
    storage: Storage, break_step_2: Callable[[Storage], None]
) -> None:
    commit_checkpoint(storage, PREFIX, 1, checkpoint_files(1), {"reward": 0.1})
    break_step_2(storage)
    assert latest_checkpoint(storage, PREFIX) == 1
    assert load_checkpoint(storage, PREFIX, 1)[1] == {"reward": 0.1}


def test_load_rejects_same_size_corruption(storage: Storage) -> None:
    commit_checkpoint(storage, PREFIX, 1, checkpoint_files(1), {})
    corrupted = b"\xff" + checkpoint_files(1)["model.safetensors"][1:]
    storage.write_bytes(f"{checkpoint_dir(PREFIX, 1)}/model.safetensors", corrupted)
    with pytest.raises(CheckpointError, match="model.safetensors does not match its manifest"):
        load_checkpoint(storage, PREFIX, 1)


def test_load_of_uncommitted_step_is_a_clear_error(storage: Storage) -> None:
    files_without_manifest(storage)
    with pytest.raises(CheckpointError, match="no manifest"):
        load_checkpoint(storage, PREFIX, 2)


def test_prune_keeps_newest_and_latest(storage: Storage) -> None:
    for step in range(1, 6):
        commit_checkpoint(storage, PREFIX, step, checkpoint_files(step), {"step": step})
    # An in-progress commit of step 6 (no manifest yet) must not be touched.
    storage.write_bytes(f"{checkpoint_dir(PREFIX, 6)}/model.safetensors", b"partial")

    assert sorted(prune_checkpoints(storage, PREFIX, keep=2)) == [1, 2, 3]
    assert storage.list(PREFIX) == [
        "LATEST.json",
        "step-00000004",
        "step-00000005",
        "step-00000006",
    ]
    assert latest_checkpoint(storage, PREFIX) == 5
    assert load_checkpoint(storage, PREFIX, 4)[1] == {"step": 4}


def test_prune_never_deletes_the_latest(storage: Storage) -> None:
    for step in (1, 2, 3):
        commit_checkpoint(storage, PREFIX, step, checkpoint_files(step), {})
    commit_checkpoint(storage, PREFIX, 1, checkpoint_files(1), {})  # pointer moved back to 1
    assert sorted(prune_checkpoints(storage, PREFIX, keep=1)) == [2]
    assert latest_checkpoint(storage, PREFIX) == 1


# ---------------------------------------------------------------------------- S3 outages


def test_checkpoint_commit_survives_paused_s3_endpoint(
    moto_s3, caplog: pytest.LogCaptureFixture
) -> None:
    """The endpoint freezes (SIGSTOP) for 3 s while a commit is in flight: writes retry."""
    storage = Storage(moto_s3.url, storage_options=FAST_S3, retry_seconds=15, upload_timeout=1)
    commit_checkpoint(storage, PREFIX, 1, checkpoint_files(1), {"reward": 0.1})

    moto_s3.server.pause()
    resume = threading.Timer(3.0, moto_s3.server.resume)
    resume.start()
    start = time.monotonic()
    try:
        commit_checkpoint(storage, PREFIX, 2, checkpoint_files(2), {"reward": 0.2})
    finally:
        resume.join()
    elapsed = time.monotonic() - start

    assert 2.5 < elapsed < 12, elapsed
    assert "retrying" in caplog.text
    assert latest_checkpoint(storage, PREFIX) == 2
    assert load_checkpoint(storage, PREFIX, 2) == (checkpoint_files(2), {"reward": 0.2})


def test_write_survives_s3_endpoint_restart(moto_s3, caplog: pytest.LogCaptureFixture) -> None:
    """The endpoint goes down for 2 s as the write arrives (connection refused, open
    connections cut), then is back on the same port. The endpoint is a proxy to moto
    (``faults.OutageProxy``), so the bucket outlives the outage (a restarted moto would come
    back empty for a moment before its bucket is re-created)."""
    upstream = ("127.0.0.1", moto_s3.server.port)
    with OutageProxy(upstream, trigger="after-restart.json", outage_s=2.0) as endpoint:
        options = {**FAST_S3, "client_kwargs": {"endpoint_url": endpoint.endpoint_url}}
        storage = Storage(moto_s3.url, storage_options=options, retry_seconds=15, upload_timeout=1)
        storage.write_json("after-restart.json", {"ok": True})
        assert endpoint.outage is not None
        # the write met the outage and was retried: refused (EndpointConnectionError) or, when
        # the machine is loaded, timed out first (FSTimeoutError), either way retried
        assert "retrying in" in caplog.text, caplog.text
        assert "EndpointConnectionError" in caplog.text or "Timeout" in caplog.text, caplog.text
        assert json.loads(storage.read_bytes("after-restart.json")) == {"ok": True}


def test_missing_bucket_fails_at_once(moto_s3) -> None:
    """A configuration error (4xx) is not retried for the whole budget."""
    storage = Storage("s3://no-such-bucket/root", storage_options=FAST_S3, retry_seconds=10)
    start = time.monotonic()
    with pytest.raises(FileNotFoundError):
        storage.write_bytes("x.bin", b"x")
    # Not retried: well under the 10 s budget (2.2 s once under the full suite's load).
    assert time.monotonic() - start < 5


def test_retries_stop_after_the_budget(moto_s3) -> None:
    storage = Storage(moto_s3.url, storage_options=FAST_S3, retry_seconds=2, upload_timeout=1)
    moto_s3.server.pause()
    start = time.monotonic()
    with pytest.raises(OSError):
        storage.write_bytes("never.bin", b"x")
    assert time.monotonic() - start < 5


def bit_flip(storage: Storage) -> None:
    """Step 3 committed, then one bit of its weights flipped (same size)."""
    data = bytearray(checkpoint_files(3)["model.safetensors"])
    data[len(data) // 2] ^= 0x01
    storage.write_bytes(f"{checkpoint_dir(PREFIX, 3)}/model.safetensors", bytes(data))


def truncation(storage: Storage) -> None:
    data = checkpoint_files(3)["model.safetensors"]
    storage.write_bytes(f"{checkpoint_dir(PREFIX, 3)}/model.safetensors", data[: len(data) // 2])


def empty_manifest(storage: Storage) -> None:
    storage.write_json(f"{checkpoint_dir(PREFIX, 3)}/manifest.json", {"step": 3, "files": {}})


def missing_pointer_target(storage: Storage) -> None:
    storage.delete(checkpoint_dir(PREFIX, 3))


@pytest.mark.parametrize("corrupt", [bit_flip, truncation, empty_manifest, missing_pointer_target])
def test_a_corrupt_latest_checkpoint_resumes_from_the_newest_intact_one(
    storage: Storage, corrupt: Callable[[Storage], None], caplog: pytest.LogCaptureFixture
) -> None:
    for step in (1, 2, 3):
        commit_checkpoint(storage, PREFIX, step, checkpoint_files(step), {"step": step})
    corrupt(storage)
    with caplog.at_level("WARNING"):
        step, files, meta = load_latest_checkpoint(storage, PREFIX)
    assert (step, files, meta) == (2, checkpoint_files(2), {"step": 2})
    if corrupt is bit_flip:  # complete by size: only the sha256 check catches it, and says so
        assert "checkpoint step 3 is corrupt" in caplog.text


def test_no_intact_checkpoint_is_a_clear_error(storage: Storage) -> None:
    commit_checkpoint(storage, PREFIX, 1, checkpoint_files(1), {})
    data = bytearray(checkpoint_files(1)["model.safetensors"])
    data[0] ^= 0xFF
    storage.write_bytes(f"{checkpoint_dir(PREFIX, 1)}/model.safetensors", bytes(data))
    with pytest.raises(CheckpointError, match="no intact checkpoint"):
        load_latest_checkpoint(storage, PREFIX)
