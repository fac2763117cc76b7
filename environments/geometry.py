"""Geometry with figures, for vision-language policies: Geometry3K files or synthetic problems.

A row has the Geometry3K layout: ``images`` (encoded PNG/JPEG bytes, one or more), ``problem``
(text), ``choices`` (option texts; may be empty) and ``answer`` (a choice letter or the value).
The environment shows the image(s) with the problem and the lettered choices
(``"Find x.\\nA)5 B)13 C)7 D)10"``); one answer, reward 1.0 iff it is right, given either as
the letter or as the value (case, spaces, brackets and a trailing period are ignored; numbers
compare by value, so ``5.0`` is ``5``).

Data (``GeometryTask``): ``data`` is a Geometry3K-layout ``.parquet``/``.jsonl`` file, local or
at any fsspec URL (``s3://``), read by ``load_geometry3k``; unset, problems are generated
(``environments.geometry_figures``: right triangles, angles, areas with exact answers). Either
way the held-out evaluation set is fixed by ``seed`` and disjoint from the training stream.
"""

from __future__ import annotations

import random
from fractions import Fraction
from functools import lru_cache
from typing import Any, ClassVar

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, Field, model_validator

from flowrl.environments.data import GeneratedSource, StaticSource, load_rows
from flowrl.environments.geometry_figures import (
    KINDS,
    LETTERS,
    Kind,
    problem_row,
    problem_space,
)
from flowrl.environments.types import StepResult
from flowrl.infra.configfile import STRICT_MODEL_CONFIG

_MAX_REDRAWS = 64
"""Random redraws of a held-out training problem before walking to the next free one."""


# --- Geometry3K layout ------------------------------------------------------------------------


def image_bytes(cell: Any) -> bytes:
    """One image cell of a row as encoded bytes: raw bytes or an HF-datasets image struct
    holding its bytes. A row arrives at run time (from a data stream, over HTTP), so a path
    or URL in it is refused, never opened: files are read only by ``load_geometry3k``."""
    if isinstance(cell, bytes | bytearray):
        return bytes(cell)
    if isinstance(cell, dict) and isinstance(cell.get("bytes"), bytes | bytearray):
        if cell["bytes"]:
            return bytes(cell["bytes"])
    raise ValueError(
        "an image in a row must be bytes (paths and URLs in rows are never opened); "
        f"got {type(cell).__name__}"
    )


def file_image_bytes(cell: Any, base: str) -> bytes:
    """One image cell of a Geometry3K data file: its bytes, or a path relative to the file's
    folder ``base``, confined to it: no absolute path, no ``..``, no URL scheme."""
    if isinstance(cell, dict):
        if cell.get("bytes"):
            return bytes(cell["bytes"])
        cell = cell.get("path")
    if isinstance(cell, bytes | bytearray):
        return bytes(cell)
    if not isinstance(cell, str) or not cell:
        raise ValueError(f"an image cell holds neither bytes nor a path: {type(cell).__name__}")
    parts = cell.replace("\\", "/").split("/")
    if ":" in cell or cell.startswith(("/", "~")) or ".." in parts or "\x00" in cell:
        raise ValueError(
            f"image path {cell!r}: only a relative path inside the data file's folder is read"
        )
    path = f"{base.rstrip('/')}/{'/'.join(p for p in parts if p not in ('', '.'))}"
    with fsspec.open(path, skip_instance_cache=True) as f:  # no client of an earlier endpoint
        return f.read()


def geometry3k_row(raw: dict[str, Any], base: str = ".") -> dict[str, Any]:
    """A raw Geometry3K-layout record as a row: ``images`` (a list of image structs) or
    ``image`` (one struct) → ``images`` as bytes; ``problem``; ``choices``; ``answer``."""
    cells = raw["images"] if raw.get("images") is not None else raw.get("image")
    cells = [] if cells is None else cells if isinstance(cells, list) else [cells]
    if "problem" not in raw or raw.get("answer") is None:
        raise ValueError("a Geometry3K row needs 'problem' and 'answer'")
    return {
        "images": [file_image_bytes(cell, base) for cell in cells],
        "problem": str(raw["problem"]),
        "choices": [str(c) for c in raw.get("choices") or []],
        "answer": str(raw["answer"]).strip(),
    }


def load_geometry3k(uri: str, storage_options: dict[str, Any] | None = None) -> list[dict]:
    """Every row of a Geometry3K-layout file (``.parquet``/``.jsonl``/``.json``, local or any
    fsspec URL). Raises ``ValueError`` naming the file and row for a malformed row."""
    base = uri.rsplit("/", 1)[0] if "/" in uri else "."
    rows = []
    for n, raw in enumerate(load_rows(uri, storage_options)):
        try:
            rows.append(geometry3k_row(raw, base))
        except (KeyError, TypeError, ValueError, OSError) as exc:
            raise ValueError(f"{uri!r}: row {n}: {exc}") from exc
    if not rows:
        raise ValueError(f"{uri!r} holds no rows")
    return rows


def save_geometry3k(rows: list[dict[str, Any]], uri: str) -> None:
    """Write rows as a Geometry3K-layout parquet file (``images`` as a list of HF image structs
    ``{"bytes", "path"}``, ``problem``, ``choices``, ``answer``) at a local path or fsspec URL."""
    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema(
        [
            ("images", pa.list_(image)),
            ("problem", pa.string()),
            ("choices", pa.list_(pa.string())),
            ("answer", pa.string()),
        ]
    )
    records = [
        {
            "images": [{"bytes": data, "path": None} for data in row["images"]],
            "problem": row["problem"],
            "choices": list(row.get("choices") or []),
            "answer": str(row["answer"]),
        }
        for row in rows
    ]
    with fsspec.open(uri, "wb", skip_instance_cache=True) as f:
        pq.write_table(pa.Table.from_pylist(records, schema=schema), f)


@lru_cache(maxsize=8)
def _cached_rows(uri: str) -> tuple[dict[str, Any], ...]:
    """A data file's rows, read once per process (each stage builds its task config anew)."""
    return tuple(load_geometry3k(uri))


# --- answers ----------------------------------------------------------------------------------


def normalise_answer(text: str) -> str:
    """Lower-case, no spaces, no surrounding brackets or trailing period; numbers by value."""
    text = "".join(str(text).split()).lower().rstrip(".")
    if len(text) > 2 and text[0] + text[-1] in ("()", "[]"):
        text = text[1:-1]
    elif len(text) == 2 and text.endswith(")"):  # "b)"
        text = text[0]
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        return text
    return str(value.numerator) if value.denominator == 1 else str(float(value))


def accepted_answers(answer: str, choices: list[str]) -> set[str]:
    """Normalised answers judged correct: the answer, plus its letter or its value."""
    accepted = {normalise_answer(answer)}
    letters = LETTERS[: len(choices)]
    letter = answer.strip().strip("()").upper()
    if len(letter) == 1 and letter in letters:
        accepted.add(normalise_answer(choices[letters.index(letter)]))
    else:
        target = normalise_answer(answer)
        pairs = zip(letters, choices, strict=False)  # choices beyond the letters go unnamed
        accepted |= {L.lower() for L, c in pairs if normalise_answer(c) == target}
    return accepted


def question_text(problem: str, choices: list[str]) -> str:
    """What the policy reads beside the figure: the problem, then the lettered choices."""
    text = problem.replace("<image>", "").strip()  # the figure is shown as an image instead
    if not choices:
        return text
    return text + "\n" + " ".join(f"{L}){c}" for L, c in zip(LETTERS, choices, strict=False))


# --- environment ------------------------------------------------------------------------------


class GeometryEnv:
    """Figure(s) + problem (+ choices) in, one answer out: reward 1.0 iff it is right."""

    def __init__(self, system_prompt: str = "") -> None:
        self.system_prompt = system_prompt
        self._question: str | None = None
        self._images: list[bytes] = []
        self._accepted: set[str] = set()
        self._done = False

    def reset(
        self,
        problem: str,
        answer: str,
        images: list[Any] | None = None,
        choices: list[str] | None = None,
        **_: Any,
    ) -> str:
        """Start an episode from a Geometry3K-layout row (extra keys are ignored)."""
        choices = [str(c) for c in choices or []]
        self._images = [image_bytes(cell) for cell in images or []]
        self._question = question_text(problem, choices)
        self._accepted = accepted_answers(str(answer), choices)
        self._done = False
        return self._question

    def get_images(self) -> list[bytes]:
        """The figure(s), shown with the first (and only) observation."""
        return [] if self._done else list(self._images)

    def step(self, action: str) -> StepResult:
        if self._question is None or self._done:
            raise RuntimeError("GeometryEnv.step called without an open episode (call reset)")
        self._done = True
        correct = normalise_answer(action) in self._accepted
        return StepResult("", 1.0 if correct else 0.0, True, {"correct": correct})

    def get_system_prompt(self) -> str:
        return self.system_prompt

    def get_initial_user_message(self) -> str:
        if self._question is None:
            raise RuntimeError("GeometryEnv has no problem yet (call reset)")
        return self._question


class GeometryTask(BaseModel):
    """Geometry problems with figures: a Geometry3K-layout file, or generated ones."""

    model_config = STRICT_MODEL_CONFIG
    shows_images: ClassVar[bool] = True
    """Its observations carry images: the policy must be a vision-language model."""

    data: str | None = Field(
        None,
        description="Geometry3K-layout file (.parquet/.jsonl; local or s3://): columns images "
        "(or image), problem, choices, answer. Unset = synthetic problems.",
    )
    eval_data: str | None = Field(
        None,
        description="Held-out file in the same layout (e.g. Geometry3K's test split); unset = "
        "eval_size rows of `data` held out of training.",
    )
    kinds: list[Kind] = Field(
        default_factory=lambda: list(KINDS),
        min_length=1,
        description="Synthetic problem kinds: hypotenuse, leg, third_angle, complement, "
        "rectangle_area, triangle_area.",
    )
    max_length: int = Field(
        20, ge=5, le=200, description="Largest side length in synthetic figures."
    )
    num_choices: int = Field(
        4, ge=0, le=8, description="Choices per synthetic problem (answer = letter); 0 = none."
    )
    numbers_in_text: bool = Field(
        True,
        description="Synthetic problems also state the figure's numbers in the text; false = "
        "'Find x.' only (Geometry3K style: everything is in the figure).",
    )
    image_size: int = Field(64, ge=16, le=1024, description="Side in pixels of synthetic figures.")
    eval_size: int = Field(50, ge=1, description="Number of held-out evaluation problems.")
    seed: int = Field(0, description="Seed of the eval split, choice order and training stream.")
    system_prompt: str = Field("", description="System prompt shown to the policy.")

    @model_validator(mode="after")
    def _check_space(self) -> GeometryTask:
        if len(set(self.kinds)) != len(self.kinds):
            raise ValueError(f"kinds has duplicates: {self.kinds}")
        if self.data is None and self.eval_size >= len(self._space()):
            raise ValueError(
                f"eval_size ({self.eval_size}) must be smaller than the synthetic problem space "
                f"({len(self._space())} problems) so that some remain for training"
            )
        return self

    def _space(self) -> tuple[tuple[str, int, int], ...]:
        return problem_space(tuple(self.kinds), self.max_length)

    def _row(self, key: tuple[str, int, int]) -> dict[str, Any]:
        row = _rendered(key, self.image_size, self.num_choices, self.numbers_in_text, self.seed)
        return dict(row)  # the cached row stays pristine

    def eval_set(self) -> list[dict[str, Any]]:
        """The fixed held-out problems: the same for the same config and seed."""
        if self.eval_data is not None:
            return [dict(row) for row in _cached_rows(self.eval_data)]
        if self.data is not None:
            rows = _cached_rows(self.data)
            return [dict(rows[i]) for i in _held_out(self.seed, len(rows), self.eval_size)[0]]
        space = self._space()
        return [self._row(space[k]) for k in _held_out(self.seed, len(space), self.eval_size)[0]]

    def problem(self, i: int) -> dict[str, Any]:
        """Synthetic training problem ``i``: deterministic in ``(config, i)``, never held out."""
        if i < 0:
            raise ValueError(f"problem index must be >= 0, got {i}")
        space = self._space()
        _, held_out = _held_out(self.seed, len(space), self.eval_size)
        rng = random.Random(f"flowrl.geometry.train:{self.seed}:{i}")
        k = rng.randrange(len(space))
        for _ in range(_MAX_REDRAWS):
            if k not in held_out:
                return self._row(space[k])
            k = rng.randrange(len(space))
        while k in held_out:
            k = (k + 1) % len(space)
        return self._row(space[k])

    def train_source(self, start: int = 0) -> GeneratedSource | StaticSource:
        """Synthetic: the endless stream ``problem(start), ...``. A data file: its rows that
        are not held out, reshuffled every epoch (``start`` is then unused: resume with
        ``load_state``)."""
        if self.data is None:
            return GeneratedSource(self.problem, start=start)
        rows = _cached_rows(self.data)
        held_out = set() if self.eval_data else _held_out(self.seed, len(rows), self.eval_size)[1]
        train = [rows[i] for i in range(len(rows)) if i not in held_out]
        if not train:
            raise ValueError(f"{self.data!r}: no rows left for training after the held-out split")
        return StaticSource(train, seed=self.seed)

    def sft_example(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        """Chat messages that teach ``row``'s answer; image parts carry their bytes
        (``flowrl.tasks.sft.sft_datum`` turns them into image tokens and ``Datum.images``)."""
        choices = [str(c) for c in row.get("choices") or []]
        images = [{"type": "image", "image": image_bytes(cell)} for cell in row["images"]]
        text = {"type": "text", "text": question_text(row["problem"], choices)}
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [
            {"role": "user", "content": [*images, text]},
            {"role": "assistant", "content": str(row["answer"]).strip()},
        ]

    def make_env(self) -> GeometryEnv:
        return GeometryEnv(system_prompt=self.system_prompt)


@lru_cache(maxsize=4096)
def _rendered(
    key: tuple[str, int, int], image_size: int, num_choices: int, numbers: bool, seed: int
) -> dict[str, Any]:
    return problem_row(key, image_size, num_choices, numbers, seed)


@lru_cache(maxsize=64)
def _held_out(seed: int, size: int, eval_size: int) -> tuple[tuple[int, ...], frozenset[int]]:
    """Indices of the held-out problems (in eval order) and the same as a set."""
    if eval_size >= size:
        raise ValueError(f"eval_size ({eval_size}) must be smaller than the data ({size} rows)")
    indices = tuple(random.Random(f"flowrl.geometry.eval:{seed}").sample(range(size), eval_size))
    return indices, frozenset(indices)
