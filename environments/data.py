"""Data sources behind the ``DataSource`` protocol: generated rows and static datasets.

Both sources are endless and resumable: ``state()`` is a tiny JSON cursor that a checkpoint
saves, and ``load_state`` puts the stream back exactly where it was.

- ``GeneratedSource``: row ``i`` is a pure function of the index (the generator closes over its
  own seed), so the cursor is just ``{"index": i}``.
- ``StaticSource``: rows read once from JSONL/JSON/parquet at any fsspec URL (``file://``,
  ``s3://``, ...), visited in a fresh seeded permutation each epoch; the cursor is
  ``{"epoch": e, "index": i}``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import PurePosixPath
from typing import Any

import fsspec

ROW_FORMATS = (".jsonl", ".json", ".parquet")
"""File extensions ``load_rows`` understands."""


def load_rows(uri: str, storage_options: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Read every row of a JSONL (one object per line), JSON (an array of objects) or parquet file.

    ``uri`` is a local path or any fsspec URL (``s3://bucket/key.parquet``); ``storage_options``
    go to the filesystem (credentials, endpoint). The format is chosen by extension.
    Raises ``ValueError`` for an unknown extension or a malformed row and ``FileNotFoundError``
    for a missing file, both naming ``uri``.
    """
    suffix = PurePosixPath(uri.split("?", 1)[0]).suffix.lower()
    if suffix not in ROW_FORMATS:
        raise ValueError(
            f"cannot read rows from {uri!r}: unknown extension {suffix!r} "
            f"(expected one of {', '.join(ROW_FORMATS)})"
        )
    # Own instance: fsspec's cache would keep a client built for an earlier AWS_ENDPOINT_URL.
    options = {"skip_instance_cache": True, **(storage_options or {})}
    fs, path = fsspec.core.url_to_fs(uri, **options)
    if not fs.isfile(path):
        raise FileNotFoundError(f"data file not found: {uri!r}")
    with fs.open(path, "rb") as f:
        if suffix == ".parquet":
            import pyarrow.parquet as pq  # only for parquet rows

            rows = pq.read_table(f).to_pylist()
        elif suffix == ".json":
            rows = json.loads(f.read().decode("utf-8"))
            if not isinstance(rows, list):
                raise ValueError(f"{uri!r}: a .json data file must hold an array of objects")
        else:
            lines = f.read().decode("utf-8").splitlines()
            rows = [_parse_line(uri, n, line) for n, line in enumerate(lines, 1) if line.strip()]
    for n, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ValueError(f"{uri!r}: row {n} is a {type(row).__name__}, not an object")
    return rows


def _parse_line(uri: str, line_number: int, line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{uri!r}: line {line_number} is not valid JSON ({exc})") from exc


class GeneratedSource:
    """An endless stream whose row ``i`` is ``generate(i)``, a pure function of the index.

    ``generate`` must be deterministic (it closes over its own seed), so resuming needs nothing
    but the index: ``state() == {"index": i}`` where ``i`` is the next row to be drawn.
    """

    def __init__(self, generate: Callable[[int], dict[str, Any]], start: int = 0) -> None:
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        self._generate = generate
        self._index = start

    def next_batch(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` rows; advances the cursor by ``n``."""
        rows = [self._generate(i) for i in range(self._index, self._index + n)]
        self._index += n
        return rows

    def state(self) -> dict[str, Any]:
        return {"index": self._index}

    def load_state(self, state: dict[str, Any]) -> None:
        index = int(state["index"])
        if index < 0:
            raise ValueError(f"invalid GeneratedSource state {state!r}: index must be >= 0")
        self._index = index


class StaticSource:
    """An endless stream over a fixed list of rows, reshuffled every epoch.

    Epoch ``e`` visits the rows in a permutation drawn from a RNG seeded by ``(seed, e)``
    (identity order when ``shuffle=False``); after the last row of an epoch the stream wraps into
    epoch ``e + 1``. ``state() == {"epoch": e, "index": i}``: the next row is the ``i``-th of
    epoch ``e``'s order.
    """

    def __init__(self, rows: list[dict[str, Any]], seed: int = 0, shuffle: bool = True) -> None:
        if not rows:
            raise ValueError("StaticSource needs at least one row")
        self._rows = list(rows)
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._index = 0
        self._order = self._epoch_order(0)

    @classmethod
    def from_uri(
        cls,
        uri: str,
        seed: int = 0,
        shuffle: bool = True,
        storage_options: dict[str, Any] | None = None,
    ) -> StaticSource:
        """Load ``uri`` (.jsonl/.json/.parquet, local or fsspec URL) with ``load_rows``."""
        rows = load_rows(uri, storage_options)
        if not rows:
            raise ValueError(f"data file {uri!r} holds no rows")
        return cls(rows, seed=seed, shuffle=shuffle)

    def __len__(self) -> int:
        return len(self._rows)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self._rows)))
        if self._shuffle:
            # A string seed is hashed with SHA-512: stable across processes and Python runs.
            random.Random(f"flowrl.StaticSource:{self._seed}:{epoch}").shuffle(order)
        return order

    def next_batch(self, n: int) -> list[dict[str, Any]]:
        """The next ``n`` rows (copies), wrapping into later epochs as needed."""
        batch = []
        for _ in range(n):
            if self._index == len(self._rows):
                self._epoch, self._index = self._epoch + 1, 0
                self._order = self._epoch_order(self._epoch)
            batch.append(dict(self._rows[self._order[self._index]]))
            self._index += 1
        return batch

    def state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "index": self._index}

    def load_state(self, state: dict[str, Any]) -> None:
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or not 0 <= index <= len(self._rows):
            raise ValueError(
                f"invalid StaticSource state {state!r} for {len(self._rows)} rows "
                "(need epoch >= 0 and 0 <= index <= number of rows)"
            )
        self._epoch, self._index = epoch, index
        self._order = self._epoch_order(epoch)
