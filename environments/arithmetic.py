"""Arithmetic: the first environment. The policy reads ``"12+7="`` and must answer ``"19"``.

Single turn, exact-match reward. Problems are generated on the fly from ``ArithmeticTask``:
every problem ``(a, op, b)`` has an index in ``[0, problem_space)``; a fixed random subset is
held out for evaluation and the training stream never yields one of them.
"""

from __future__ import annotations

import random
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from flowrl.environments.data import GeneratedSource
from flowrl.environments.types import StepResult
from flowrl.infra.configfile import STRICT_MODEL_CONFIG

Operator = Literal["+", "-", "*"]

_APPLY = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_MAX_REDRAWS = 64
"""Random redraws of a held-out training problem before walking to the next free index."""


class ArithmeticEnv:
    """One question, one answer: reward 1.0 iff the stripped action equals the answer."""

    observation_roles: tuple[str, ...] = ()
    """Single-turn: no observation follows the answer (``types.OBSERVATION_ROLES``)."""

    def __init__(self, system_prompt: str = "") -> None:
        self.system_prompt = system_prompt
        self._question: str | None = None
        self._answer: str | None = None
        self._done = False

    def reset(self, question: str, answer: str, **_: Any) -> str:
        """Start an episode from a row ``{"question": "12+7=", "answer": "19"}``."""
        self._question, self._answer, self._done = question, str(answer).strip(), False
        return question

    def step(self, action: str) -> StepResult:
        if self._answer is None or self._done:
            raise RuntimeError("ArithmeticEnv.step called without an open episode (call reset)")
        self._done = True
        correct = action.strip() == self._answer
        return StepResult(
            observation="", reward=1.0 if correct else 0.0, done=True, info={"correct": correct}
        )

    def get_system_prompt(self) -> str:
        return self.system_prompt

    def get_initial_user_message(self) -> str:
        if self._question is None:
            raise RuntimeError("ArithmeticEnv has no question yet (call reset)")
        return self._question


class ArithmeticTask(BaseModel):
    """Problems ``a op b =`` with ``a`` and ``b`` drawn from inclusive ranges."""

    model_config = STRICT_MODEL_CONFIG

    min_operand: int = Field(0, ge=0, description="Smallest first operand.")
    max_operand: int = Field(99, ge=0, description="Largest first operand.")
    min_operand2: int = Field(0, ge=0, description="Smallest second operand.")
    max_operand2: int = Field(9, ge=0, description="Largest second operand.")
    operators: list[Operator] = Field(
        default_factory=lambda: ["+"], min_length=1, description="Operators to draw from."
    )
    eval_size: int = Field(200, ge=1, description="Number of held-out evaluation problems.")
    seed: int = Field(0, description="Seed of the eval split and of the training stream.")
    system_prompt: str = Field(
        "", description="System prompt shown to the policy (keep it short or empty)."
    )
    answer_width: int = Field(
        0,
        ge=0,
        le=1024,
        description="SFT answers are right-padded with spaces to this many characters (the "
        "reward strips them): long answers make generation dominate, for benchmarks; 0 = none.",
    )

    @model_validator(mode="after")
    def _check_ranges(self) -> ArithmeticTask:
        if self.min_operand > self.max_operand:
            raise ValueError(f"min_operand ({self.min_operand}) > max_operand ({self.max_operand})")
        if self.min_operand2 > self.max_operand2:
            raise ValueError(
                f"min_operand2 ({self.min_operand2}) > max_operand2 ({self.max_operand2})"
            )
        if len(set(self.operators)) != len(self.operators):
            raise ValueError(f"operators has duplicates: {self.operators}")
        if self.eval_size >= self.problem_space:
            raise ValueError(
                f"eval_size ({self.eval_size}) must be smaller than the problem space "
                f"({self.problem_space} problems) so that some remain for training"
            )
        return self

    @property
    def problem_space(self) -> int:
        """Number of distinct problems."""
        span1 = self.max_operand - self.min_operand + 1
        span2 = self.max_operand2 - self.min_operand2 + 1
        return span1 * span2 * len(self.operators)

    def _row(self, k: int) -> dict[str, str]:
        """Problem number ``k`` of the space, as a data row."""
        span1 = self.max_operand - self.min_operand + 1
        k, op_index = divmod(k, len(self.operators))
        k, a_offset = divmod(k, span1)
        a, b, op = self.min_operand + a_offset, self.min_operand2 + k, self.operators[op_index]
        return {"question": f"{a}{op}{b}=", "answer": str(_APPLY[op](a, b))}

    def eval_set(self) -> list[dict[str, str]]:
        """The fixed held-out problems: distinct, and the same for the same config and seed."""
        indices, _ = _held_out(self.seed, self.problem_space, self.eval_size)
        return [self._row(k) for k in indices]

    def problem(self, i: int) -> dict[str, str]:
        """Training problem ``i``: deterministic in ``(config, i)``, never a held-out problem."""
        if i < 0:
            raise ValueError(f"problem index must be >= 0, got {i}")
        rng = random.Random(f"flowrl.arithmetic.train:{self.seed}:{i}")
        _, held_out = _held_out(self.seed, self.problem_space, self.eval_size)
        k = rng.randrange(self.problem_space)
        for _ in range(_MAX_REDRAWS):
            if k not in held_out:
                return self._row(k)
            k = rng.randrange(self.problem_space)
        while k in held_out:  # a nearly all-held-out space: walk to the next free problem
            k = (k + 1) % self.problem_space
        return self._row(k)

    def train_source(self, start: int = 0) -> GeneratedSource:
        """The endless training stream ``problem(start), problem(start + 1), ...``."""
        return GeneratedSource(self.problem, start=start)

    def sft_example(self, row: dict[str, Any]) -> list[dict[str, str]]:
        """Chat messages that teach the answer to ``row`` (for supervised fine-tuning)."""
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": str(row["answer"]).ljust(self.answer_width)},
        ]

    def make_env(self) -> ArithmeticEnv:
        return ArithmeticEnv(system_prompt=self.system_prompt)


@lru_cache(maxsize=64)
def _held_out(
    seed: int, problem_space: int, eval_size: int
) -> tuple[tuple[int, ...], frozenset[int]]:
    """Indices of the held-out problems (in eval order) and the same as a set.

    Cached here rather than on the frozen model, so ``model_copy(update=...)`` never sees a
    stale split.
    """
    indices = tuple(
        random.Random(f"flowrl.arithmetic.eval:{seed}").sample(range(problem_space), eval_size)
    )
    return indices, frozenset(indices)
