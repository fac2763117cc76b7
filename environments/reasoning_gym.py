"""reasoning-gym's procedural datasets as flowrl environments, by name (``flowrl[envs]``).

``env.name: reasoning_gym:<dataset>`` trains on any dataset of reasoning-gym's own registry
(``reasoning_gym.factory.DATASETS``: ``basic_arithmetic``, ``propositional_logic``,
``word_sorting``, ...); ``reasoning_gym:composite`` trains on several at once.

``env.params`` holds two kinds of keys, kept apart by name:

- **flowrl's fields** (``FLOWRL_FIELDS``): ``eval_size``, ``seed``, ``chunk_size``,
  ``system_prompt``, ``max_answer_chars`` (and ``datasets`` for the composite), documented on
  ``ReasoningGymTask``;
- **every other key is the dataset's config**, passed as is to
  ``reasoning_gym.create_dataset(dataset, **config)``; a field the dataset rejects fails
  validation with the dataset's own message (a field typed as an ``Enum`` takes a member's
  value or name as text, as YAML gives it). The dataset config's ``seed`` and ``size`` are
  flowrl's to set (rows are drawn from seeds that flowrl derives from its ``seed``), so they
  are refused there.

**Rows.** Row ``i`` of a stream is item ``i % chunk_size`` of the dataset built with
``seed = H(stream, seed, dataset, i // chunk_size)`` (``H``: SHA-256, 31 bits), where the
stream is ``eval`` or ``train``: the held-out and training rows come from different seeds. As
reasoning-gym's generators draw item ``j`` from ``Random(seed + j)``, two seeds can still meet,
and a small problem space repeats questions whatever the seed; so the split is also disjoint
by content: a training row whose question is held out is redrawn (``_MAX_REDRAWS`` times, then
an error saying that the held-out set covers nearly every question). A row carries only a
reference, ``{"dataset", "seed", "index"}`` besides its question and answer; the environment
rebuilds the entry from its own config, never trusting a row's text or metadata.

**Reward.** The dataset's own ``score_answer(answer, entry)``, a float in [0, 1]; an episode is
correct (accuracy) iff the score is exactly 1. The answer is the text inside the *last*
``<answer>...</answer>`` of the reply when it has one (reasoning-gym's convention), else the
whole reply, stripped. Model output is never evaluated by flowrl, but a few datasets' scorers
evaluate the answer text themselves (``spiral_matrix`` calls ``eval``; ``countdown`` and
``puzzle24`` use sympy's ``parse_expr``): so an answer longer than ``max_answer_chars`` or
that looks like code (``_UNSAFE``: a dunder, an ``import``/``lambda``, a call of ``eval``,
``exec``, ``open``, ...) scores 0 without reaching the scorer (``info["rejected"]``), and a
scorer that raises scores 0 (``info["score_error"]``).

**Warm-up.** ``sft_example`` demonstrates the dataset's own answer as the whole reply (the
plain answer, which the extraction above takes as is).

**Composite.** ``reasoning_gym:composite`` with ``datasets: [{name, weight, config}, ...]``
(the fields of reasoning-gym's ``DatasetSpec``): each row picks its dataset by weight (a
deterministic draw per row), then is drawn from that dataset as above; held-out rows are
picked the same way. The reward is the picked dataset's scorer. This is flowrl's sampling, not
reasoning-gym's ``CompositeDataset`` (whose name it shadows), so each dataset keeps its own
disjoint split.
"""

from __future__ import annotations

import difflib
import enum
import hashlib
import json
import random
import re
import typing
from functools import cache, lru_cache
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flowrl.environments.data import GeneratedSource
from flowrl.environments.types import StepResult
from flowrl.infra.configfile import STRICT_MODEL_CONFIG

PREFIX = "reasoning_gym:"
"""``env.name`` prefix: ``reasoning_gym:<dataset>``."""
COMPOSITE = "composite"
"""``reasoning_gym:composite``: several datasets with weights, as one environment."""
INSTALL_HINT = "pip install 'flowrl[envs]'"
FLOWRL_FIELDS = ("eval_size", "seed", "chunk_size", "system_prompt", "max_answer_chars")
"""``env.params`` keys that are flowrl's; every other key is the dataset's config."""
RESERVED_CONFIG = ("seed", "size")
"""Dataset config fields flowrl sets itself."""
_MAX_REDRAWS = 64
"""Redraws of a training row whose question is held out before giving up."""
_OPEN, _CLOSE = "<answer>", "</answer>"
_UNSAFE = re.compile(
    r"__|\b(?:import|lambda)\b|\b(?:eval|exec|compile|open|getattr|setattr|delattr|globals"
    r"|locals|vars|input|breakpoint|help|exit|quit|memoryview|classmethod|staticmethod)\s*\("
)
"""Answer text that looks like code: never handed to a dataset's scorer."""


class ReasoningGymMissing(ImportError):
    """reasoning-gym is not installed (the ``envs`` extra)."""


def _library() -> Any:
    """The ``reasoning_gym`` package, imported on first use only."""
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ReasoningGymMissing(
            f"reasoning-gym environments need the reasoning-gym package: {INSTALL_HINT} "
            f"({type(exc).__name__}: {exc})"
        ) from exc
    return reasoning_gym


def dataset_names() -> list[str]:
    """Every dataset in reasoning-gym's own registry."""
    _library()
    from reasoning_gym.factory import DATASETS

    return sorted(DATASETS)


EVALUATING_SCORERS = frozenset(
    {
        "binary_matrix",
        "countdown",
        "intermediate_integration",
        "n_queens",
        "polynomial_multiplication",
        "puzzle24",
        "simple_integration",
        "spiral_matrix",
        "string_insertion",
    }
)
"""Datasets whose own ``score_answer`` runs the model's answer as code (Python ``eval``, or
sympy's ``parse_expr``, which evaluates too; read in reasoning-gym 0.1.25's source): flowrl
never evaluates model output, so these are refused by name."""


def check_dataset_name(name: str) -> None:
    """Raise ``ValueError`` for a name not in reasoning-gym's registry (listing the nearest) or
    one whose scorer evaluates the model's answer (``EVALUATING_SCORERS``)."""
    names = dataset_names()
    if name in EVALUATING_SCORERS:
        raise ValueError(
            f"reasoning-gym dataset {name!r} is refused: its score_answer evaluates the model's "
            "answer as code (eval / sympy parse_expr), and flowrl never runs model output"
        )
    if name in names:
        return
    near = difflib.get_close_matches(name, names, n=5, cutoff=0.0)
    raise ValueError(
        f"unknown reasoning-gym dataset {name!r}; nearest: {', '.join(near)} "
        f"({len(names)} datasets: reasoning_gym.factory.DATASETS)"
    )


def extract_answer(reply: str) -> str:
    """The answer in a reply: the last ``<answer>...</answer>``'s text, else the whole reply."""
    end = reply.rfind(_CLOSE)  # linear in the reply's length, whatever it holds
    start = reply.rfind(_OPEN, 0, end) if end >= 0 else -1
    return (reply[start + len(_OPEN) : end] if start >= 0 else reply).strip()


def _derive_seed(*parts: object) -> int:
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


@lru_cache(maxsize=32)
def _dataset(name: str, config_json: str, seed: int, size: int) -> Any:
    """One chunk of a dataset (cached per process: envs are built per episode)."""
    config = _coerce_enums(name, json.loads(config_json))
    return _library().create_dataset(name, **config, seed=seed, size=size)


def _coerce_enums(name: str, config: dict[str, Any]) -> dict[str, Any]:
    """A config field typed as an ``Enum``, or as a list of one, takes its values' names or
    values from YAML (e.g. ``word_sorting``'s ``transformation: lowercase``, ``aiw``'s
    ``task_types: [friends]``); anything else passes as is."""
    from reasoning_gym.factory import DATASETS

    if name not in DATASETS:
        return config
    try:
        hints = typing.get_type_hints(DATASETS[name][1])
    except Exception:  # unresolvable annotations: leave the config to the dataset
        return config
    out = dict(config)
    for key, value in config.items():
        hint = hints.get(key)
        if _is_enum(hint) and isinstance(value, str):
            out[key] = _member(hint, value)
        elif typing.get_origin(hint) in (list, tuple) and isinstance(value, list):
            item = (typing.get_args(hint) or (None,))[0]  # list[E], tuple[E, ...]
            if _is_enum(item):
                out[key] = [_member(item, v) if isinstance(v, str) else v for v in value]
    return out


def _is_enum(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, enum.Enum)


def _member(kind: type[enum.Enum], value: str) -> Any:
    """The member of ``kind`` whose name or value is ``value`` (any case); else ``value``."""
    members = {m.name.lower(): m for m in kind} | {str(m.value).lower(): m for m in kind}
    return members.get(value.lower(), value)


class DatasetSpec(BaseModel):
    """One dataset of a composite (reasoning-gym's ``DatasetSpec`` fields)."""

    model_config = STRICT_MODEL_CONFIG

    name: str = Field(description="A reasoning-gym dataset name.")
    weight: float = Field(1.0, gt=0, description="Relative share of rows (train and held-out).")
    config: dict[str, Any] = Field(
        default_factory=dict, description="The dataset's config (create_dataset's keywords)."
    )


class ReasoningGymTask(BaseModel):
    """A reasoning-gym dataset as a task config; ``env.params`` beyond these fields are the
    dataset's config. Built per dataset by ``task_class`` (``env.name: reasoning_gym:NAME``)."""

    model_config = ConfigDict(frozen=True, extra="allow")

    dataset_name: ClassVar[str] = ""
    """The dataset (set on each per-dataset subclass)."""

    eval_size: int = Field(200, ge=1, le=100_000, description="Held-out rows (distinct).")
    seed: int = Field(
        0, ge=0, description="Derives the dataset seeds of the held-out and training rows."
    )
    chunk_size: int = Field(
        256,
        ge=1,
        le=100_000,
        description="Rows drawn from one dataset seed before the next (the dataset's size).",
    )
    system_prompt: str = Field("", description="System prompt shown to the policy.")
    max_answer_chars: int = Field(
        4096, ge=1, description="A longer extracted answer scores 0 without being scored."
    )

    @model_validator(mode="after")
    def _check_datasets(self) -> ReasoningGymTask:
        for name, _, config in self.specs():
            _check_config(name, config)
        return self

    def specs(self) -> list[tuple[str, float, dict[str, Any]]]:
        """``(dataset, weight, config)`` of each dataset this task draws from."""
        return [(self.dataset_name, 1.0, dict(self.model_extra or {}))]

    def _config_json(self, name: str) -> str:
        config = next(c for n, _, c in self.specs() if n == name)
        return json.dumps(config, sort_keys=True)

    def _pick(self, stream: str, i: int) -> str:
        specs = self.specs()
        if len(specs) == 1:
            return specs[0][0]
        rng = random.Random(f"flowrl.reasoning_gym.pick:{stream}:{self.seed}:{i}")
        return rng.choices([n for n, _, _ in specs], weights=[w for _, w, _ in specs])[0]

    def _ref_entry(self, stream: str, name: str, i: int) -> tuple[dict[str, Any], int, int]:
        chunk, index = divmod(i, self.chunk_size)
        seed = _derive_seed("flowrl.reasoning_gym", stream, self.seed, name, chunk)
        return self.entry(name, seed, index), seed, index

    def entry(self, dataset: Any, seed: Any, index: Any) -> dict[str, Any]:
        """The dataset's entry that a row refers to, rebuilt from this config; raises
        ``ValueError`` for a reference that is not one of this task's."""
        names = [n for n, _, _ in self.specs()]
        if dataset not in names:
            raise ValueError(f"row's dataset {dataset!r} is not one of this task's ({names})")
        for key, value, top in (("seed", seed, 0x7FFFFFFF), ("index", index, self.chunk_size - 1)):
            if type(value) is not int or not 0 <= value <= top:
                raise ValueError(f"row's {key} must be an int in [0, {top}], got {value!r}")
        return self.dataset(dataset, seed)[index]

    def dataset(self, name: str, seed: int) -> Any:
        """The reasoning-gym dataset ``name`` with this task's config, seeded ``seed``."""
        return _dataset(name, self._config_json(name), seed, self.chunk_size)

    def _row(self, name: str, entry: dict[str, Any], seed: int, index: int) -> dict[str, Any]:
        answer = entry.get("answer")
        return {
            "question": str(entry["question"]),
            "answer": None if answer is None else str(answer),
            "dataset": name,
            "seed": seed,
            "index": index,
        }

    def _split(self) -> tuple[list[dict[str, Any]], dict[str, frozenset[str]]]:
        key = f"{type(self).__qualname__}|{self.model_dump_json()}"
        if key not in _SPLITS:
            if len(_SPLITS) >= 16:
                _SPLITS.clear()
            _SPLITS[key] = self._draw_eval()
        return _SPLITS[key]

    def _draw_eval(self) -> tuple[list[dict[str, Any]], dict[str, frozenset[str]]]:
        rows: list[dict[str, Any]] = []
        seen: dict[str, set[str]] = {n: set() for n, _, _ in self.specs()}
        cursor = dict.fromkeys(seen, 0)
        for k in range(self.eval_size):
            name = self._pick("eval", k)
            for _ in range(4 * self.eval_size + 64):
                entry, seed, index = self._ref_entry("eval", name, cursor[name])
                cursor[name] += 1
                if entry["question"] not in seen[name]:
                    break
            else:
                raise ValueError(
                    f"reasoning-gym dataset {name!r} yields only {len(seen[name])} distinct "
                    "questions with this config: lower eval_size or widen the config"
                )
            seen[name].add(entry["question"])
            rows.append(self._row(name, entry, seed, index))
        return rows, {n: frozenset(q) for n, q in seen.items()}

    def eval_set(self) -> list[dict[str, Any]]:
        """The held-out rows: distinct questions, the same for the same params."""
        return [dict(r) for r in self._split()[0]]

    def problem(self, i: int) -> dict[str, Any]:
        """Training row ``i``: deterministic in ``(params, i)``; its question is never held out."""
        if i < 0:
            raise ValueError(f"row index must be >= 0, got {i}")
        name = self._pick("train", i)
        held_out = self._split()[1][name]
        entry, seed, index = self._ref_entry("train", name, i)
        rng = random.Random(f"flowrl.reasoning_gym.redraw:{self.seed}:{i}")
        for _ in range(_MAX_REDRAWS):
            if entry["question"] not in held_out:
                return self._row(name, entry, seed, index)
            index = rng.randrange(self.chunk_size)
            entry = self.entry(name, seed, index)
        raise ValueError(
            f"reasoning-gym dataset {name!r}: the held-out set covers nearly every question of "
            "this config: lower eval_size or widen the config"
        )

    def train_source(self, start: int = 0) -> GeneratedSource:
        """The endless training stream ``problem(start), problem(start + 1), ...``."""
        return GeneratedSource(self.problem, start=start)

    @property
    def has_demonstrations(self) -> bool:
        """Whether the dataset gives reference answers (warm-up demonstrates them)."""
        return all(r["answer"] is not None for r in self._split()[0][:8])

    def sft_example(self, row: dict[str, Any]) -> list[dict[str, str]]:
        """The dataset's own answer to ``row`` as the whole reply (warm-up SFT)."""
        entry = self.entry(row.get("dataset"), row.get("seed"), row.get("index"))
        if entry.get("answer") is None:
            raise ValueError(
                f"reasoning-gym dataset {row.get('dataset')!r} has no reference answer to "
                "demonstrate: disable warm-up (warmup.enabled: false)"
            )
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [
            {"role": "user", "content": str(entry["question"])},
            {"role": "assistant", "content": str(entry["answer"])},
        ]

    def make_env(self) -> ReasoningGymEnv:
        return ReasoningGymEnv(self)


class CompositeTask(ReasoningGymTask):
    """Several reasoning-gym datasets with weights as one environment
    (``env.name: reasoning_gym:composite``); no dataset config at the top level."""

    model_config = STRICT_MODEL_CONFIG

    dataset_name: ClassVar[str] = COMPOSITE
    datasets: list[DatasetSpec] = Field(
        min_length=1, description="The datasets: [{name, weight, config}, ...], names distinct."
    )

    @model_validator(mode="before")
    @classmethod
    def _names_first(cls, data: Any) -> Any:
        if isinstance(data, dict):
            names = [
                d.get("name") if isinstance(d, dict) else None for d in data.get("datasets") or []
            ]
            dupes = sorted({n for n in names if n is not None and names.count(n) > 1})
            if dupes:
                raise ValueError(f"datasets has duplicate names: {dupes}")
            if COMPOSITE in names:
                raise ValueError("a composite's datasets cannot include 'composite'")
            for name in names:
                if isinstance(name, str):
                    check_dataset_name(name)
        return data

    def specs(self) -> list[tuple[str, float, dict[str, Any]]]:
        return [(d.name, d.weight, dict(d.config)) for d in self.datasets]


class ReasoningGymEnv:
    """One question of a reasoning-gym dataset; reward = the dataset's ``score_answer``."""

    observation_roles: tuple[str, ...] = ()
    """Single-turn: no observation follows the answer."""

    def __init__(self, task: ReasoningGymTask) -> None:
        self.task = task
        self._dataset: str | None = None
        self._seed = 0
        self._entry: dict[str, Any] | None = None
        self._done = False

    def reset(self, dataset: Any = None, seed: Any = None, index: Any = None, **_: Any) -> str:
        """Start an episode from a row's reference (its question and answer are not read)."""
        self._entry = self.task.entry(dataset, seed, index)
        self._dataset, self._seed, self._done = dataset, seed, False
        return str(self._entry["question"])

    def step(self, action: str) -> StepResult:
        if self._entry is None or self._done:
            raise RuntimeError("ReasoningGymEnv.step called without an open episode (call reset)")
        self._done = True
        answer = extract_answer(str(action))
        info: dict[str, Any] = {"dataset": self._dataset}
        if len(answer) > self.task.max_answer_chars:
            info["rejected"] = f"answer longer than {self.task.max_answer_chars} characters"
        elif _UNSAFE.search(answer):
            info["rejected"] = "answer looks like code"
        if "rejected" in info:
            score = 0.0
        else:
            try:
                scorer = self.task.dataset(self._dataset, self._seed).score_answer
                score = float(scorer(answer, self._entry))
            except Exception as exc:  # a dataset's scorer failing on odd text
                info["score_error"] = f"{type(exc).__name__}: {exc}"[:200]
                score = 0.0
        if not 0.0 <= score <= 1.0:  # NaN included
            score = 0.0
        info["correct"] = score == 1.0
        return StepResult(observation="", reward=score, done=True, info=info)

    def get_system_prompt(self) -> str:
        return self.task.system_prompt

    def get_initial_user_message(self) -> str:
        if self._entry is None:
            raise RuntimeError("ReasoningGymEnv has no question yet (call reset)")
        return str(self._entry["question"])


_SPLITS: dict[str, tuple[list[dict[str, Any]], dict[str, frozenset[str]]]] = {}


def _check_config(name: str, config: dict[str, Any]) -> None:
    reserved = sorted(set(config) & set(RESERVED_CONFIG))
    if reserved:
        raise ValueError(
            f"reasoning-gym dataset {name!r}: {reserved} are set by flowrl (rows come from "
            "seeds derived from env.params.seed; use eval_size and chunk_size)"
        )
    try:
        json.dumps(config, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(
            f"reasoning-gym dataset {name!r}: config is not JSON data: {exc}"
        ) from None
    try:  # built and one row drawn: some configs fail only when a row is drawn
        _dataset(name, json.dumps(config, sort_keys=True), 0, 1)[0]
    except ReasoningGymMissing:
        raise
    except Exception as exc:
        raise ValueError(
            f"reasoning-gym dataset {name!r} rejects its config {config!r}: "
            f"{type(exc).__name__}: {exc}"
        ) from None


_CLASS_PREFIX = "Task_"


def task_class(dataset: str) -> type[ReasoningGymTask]:
    """The task config class of ``dataset`` (``CompositeTask`` for ``composite``); raises
    ``ValueError`` listing the nearest names for an unknown one, ``ReasoningGymMissing`` without
    the library. Reachable as this module's ``Task_<dataset>`` so that it pickles by name."""
    _library()
    if dataset == COMPOSITE:
        return CompositeTask
    check_dataset_name(dataset)
    return _dataset_class(dataset)


@cache
def _dataset_class(dataset: str) -> type[ReasoningGymTask]:
    name = _CLASS_PREFIX + dataset
    return type(
        name,
        (ReasoningGymTask,),
        {
            "__module__": __name__,
            "__qualname__": name,
            "__doc__": f"reasoning-gym's {dataset!r} dataset as a task config.",
            "dataset_name": dataset,
        },
    )


def __getattr__(name: str) -> Any:
    """``Task_<dataset>``: the per-dataset classes, built on first use (unpickling included)."""
    if name.startswith(_CLASS_PREFIX):
        try:
            return task_class(name[len(_CLASS_PREFIX) :])
        except ValueError:
            pass
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
