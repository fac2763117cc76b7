"""Math with a calculator tool: multi-turn. The policy reads ``"47*86="`` and may call a tool.

Protocol (also stated in the default system prompt):

- a tool call is an assistant turn containing ``<tool_call>{"expr": "47*86"}</tool_call>``
  (the OpenAI-style ``{"name": "calculator", "arguments": {"expr": ...}}`` is accepted too);
  the environment evaluates the expression with ``environments.calculator`` and answers with a
  TOOL message (``StepResult.info["observation_role"] == "tool"``): the result, or
  ``error: <why>`` for a refused expression or a malformed call (bad JSON, missing ``expr``,
  unknown tool, more than one call in a turn, too many calls). Nothing here ever raises on
  policy text;
- any assistant turn without ``<tool_call>`` is the final answer, scored by exact match
  (``correct_reward``) plus ``format_reward`` when every call was well-formed and the answer
  is a plain integer; the episode then ends.

Info fields (every step carries all of them, so the flow averages them as ``env/<field>``):
``correct``, ``tool_calls`` (calls attempted), ``tool_errors`` (malformed or refused calls),
``used_tool`` (at least one call attempted) and ``correct_tool_use``: the final answer equals
the result of a successful call of this episode, i.e. the answer relies on the tool.
"""

from __future__ import annotations

import json
import math
import random
import re
import time
from functools import lru_cache
from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from flowrl.environments.calculator import CalculatorError, calculate
from flowrl.environments.data import GeneratedSource
from flowrl.environments.types import StepResult
from flowrl.infra.configfile import STRICT_MODEL_CONFIG

TOOL_NAME = "calculator"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
DEFAULT_SYSTEM_PROMPT = 'Tool: <tool_call>{"expr": "2*3"}</tool_call> then answer.'
"""Short on purpose: the tiny policy is char-level and every character costs context."""
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_INTEGER = re.compile(r"-?\d+", re.ASCII)
MAX_CALL_CHARS = 1000
"""Longest JSON payload of one call that is parsed at all (the expression itself is at most
``calculator.MAX_EXPR_CHARS``)."""
ProblemForm = Literal["a*b", "a+b*c"]


def tool_call_text(expr: str) -> str:
    """The exact text of a well-formed call, as the policy should write it."""
    return f"{CALL_OPEN}{json.dumps({'expr': expr})}{CALL_CLOSE}"


def parse_tool_call(action: str) -> str | None:
    """The expression of the call in ``action``; ``None`` if ``action`` holds no call (a final
    answer). Raises ``CalculatorError`` explaining a malformed call."""
    if CALL_OPEN not in action and CALL_CLOSE not in action:
        return None
    calls = _CALL.findall(action)
    if not calls:
        raise CalculatorError(f"malformed call: write {CALL_OPEN}{{...}}{CALL_CLOSE}")
    if len(calls) > 1:
        raise CalculatorError("one tool call per turn")
    if len(calls[0]) > MAX_CALL_CHARS:
        raise CalculatorError(f"call too long ({len(calls[0])} > {MAX_CALL_CHARS} characters)")
    try:
        payload = json.loads(calls[0])
    except (ValueError, RecursionError):  # bad JSON, a 4,300-digit number, a deep nest
        raise CalculatorError('bad JSON: write {"expr": "..."}') from None
    if not isinstance(payload, dict):
        raise CalculatorError('bad call: write {"expr": "..."}')
    name = payload.get("name", TOOL_NAME)
    if name != TOOL_NAME:
        raise CalculatorError(f"unknown tool {str(name)[:20]!r}; the only tool is {TOOL_NAME!r}")
    arguments = payload.get("arguments", payload)
    if not isinstance(arguments, dict) or "expr" not in arguments:
        raise CalculatorError('missing "expr"')
    if not isinstance(arguments["expr"], str):
        raise CalculatorError('"expr" must be a string')
    return arguments["expr"]


_Z99 = 2.3263478740408408  # the standard normal's 99th percentile


def tool_latency_s(question: str, call: int, median_s: float, p99_s: float) -> float:
    """How long tool call ``call`` of the episode of ``question`` waits: log-normal with the
    given median and 99th percentile (a heavy tail: median 0.05 s, p99 2 s puts one call in
    a thousand over ~7 s). Drawn from (question, call) alone, so an episode waits the same
    whatever else runs beside it, and seeded runs stay reproducible."""
    if median_s <= 0:
        return 0.0
    sigma = math.log(p99_s / median_s) / _Z99
    rng = random.Random(f"flowrl.tool_math.latency:{question}:{call}")
    return rng.lognormvariate(math.log(median_s), sigma)


class ToolMathEnv:
    """One question; tool calls answered as TOOL messages; the first plain turn is the answer."""

    observation_roles = ("tool",)
    """Every observation answers a tool call (``types.OBSERVATION_ROLES``)."""

    def __init__(
        self,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        max_tool_calls: int = 3,
        correct_reward: float = 1.0,
        format_reward: float = 0.0,
        tool_latency: tuple[float, float] = (0.0, 0.0),
    ) -> None:
        self.system_prompt = system_prompt
        self.tool_latency = tool_latency
        self.max_tool_calls = max_tool_calls
        self.correct_reward = correct_reward
        self.format_reward = format_reward
        self._question: str | None = None
        self._answer = ""
        self._done = False
        self._calls = self._errors = 0
        self._results: list[str] = []

    def reset(self, question: str, answer: str, **_: Any) -> str:
        """Start an episode from a row ``{"question": "47*86=", "answer": "4042"}``."""
        self._question, self._answer, self._done = question, str(answer).strip(), False
        self._calls = self._errors = 0
        self._results = []
        return question

    def step(self, action: str) -> StepResult:
        if self._question is None or self._done:
            raise RuntimeError("ToolMathEnv.step called without an open episode (call reset)")
        try:
            expr = parse_tool_call(action)
        except CalculatorError as exc:
            self._calls += 1
            return self._tool_reply(f"error: {exc}", ok=False)
        if expr is None:
            return self._final(action.strip())
        self._calls += 1
        if self._calls > self.max_tool_calls:
            return self._tool_reply(f"error: at most {self.max_tool_calls} calls", ok=False)
        wait = tool_latency_s(self._question, self._calls, *self.tool_latency)
        if wait > 0:
            time.sleep(wait)  # a slow tool (a remote service): the episode waits, nothing else
        try:
            result = calculate(expr)
        except CalculatorError as exc:
            return self._tool_reply(f"error: {exc}", ok=False)
        self._results.append(result)
        return self._tool_reply(result, ok=True)

    def _tool_reply(self, text: str, ok: bool) -> StepResult:
        self._errors += not ok
        info = self._info(correct=False, relied=False) | {"observation_role": "tool"}
        return StepResult(observation=text, reward=0.0, done=False, info=info)

    def _final(self, answer: str) -> StepResult:
        self._done = True
        correct = answer == self._answer
        well_formed = self._errors == 0 and _INTEGER.fullmatch(answer) is not None
        reward = self.correct_reward * correct + self.format_reward * well_formed
        info = self._info(correct=correct, relied=answer in self._results)
        return StepResult(observation="", reward=float(reward), done=True, info=info)

    def _info(self, correct: bool, relied: bool) -> dict[str, Any]:
        return {
            "correct": correct,
            "tool_calls": self._calls,
            "tool_errors": self._errors,
            "used_tool": self._calls > 0,
            "correct_tool_use": relied,
        }

    def get_system_prompt(self) -> str:
        return self.system_prompt

    def get_initial_user_message(self) -> str:
        if self._question is None:
            raise RuntimeError("ToolMathEnv has no question yet (call reset)")
        return self._question


class ToolMathTask(BaseModel):
    """Problems the tiny policy cannot do in its head (``a*b`` with two-digit operands, or
    ``a+b*c``) but can do by copying them into a calculator call and copying the result back."""

    model_config = STRICT_MODEL_CONFIG

    forms: list[ProblemForm] = Field(
        default_factory=lambda: ["a*b"], min_length=1, description="Problem shapes to draw from."
    )
    min_operand: int = Field(10, ge=0, description="Smallest operand.")
    max_operand: int = Field(99, ge=0, description="Largest operand.")
    max_tool_calls: int = Field(
        3, ge=0, description="Tool calls allowed per episode; later calls get an error."
    )
    correct_reward: float = Field(1.0, description="Reward of an exactly correct final answer.")
    format_reward: float = Field(
        0.0,
        description="Added at the end when every call was well-formed and the answer is an "
        "integer.",
    )
    eval_size: int = Field(
        200, ge=1, le=10_000, description="Number of held-out evaluation problems."
    )
    seed: int = Field(0, description="Seed of the eval split and of the training stream.")
    tool_latency_median_s: float = Field(
        0.0, ge=0, le=60, description="Median wait of a tool call (log-normal); 0 = none."
    )
    tool_latency_p99_s: float = Field(
        0.0, ge=0, le=600, description="99th percentile of a tool call's wait (>= the median)."
    )
    system_prompt: str = Field(
        DEFAULT_SYSTEM_PROMPT, description="System prompt shown to the policy (states the format)."
    )

    @model_validator(mode="after")
    def _check(self) -> ToolMathTask:
        if self.min_operand > self.max_operand:
            raise ValueError(f"min_operand ({self.min_operand}) > max_operand ({self.max_operand})")
        if self.tool_latency_median_s > 0 and self.tool_latency_p99_s < self.tool_latency_median_s:
            raise ValueError(
                f"tool_latency_p99_s ({self.tool_latency_p99_s}) is under "
                f"tool_latency_median_s ({self.tool_latency_median_s})"
            )
        if len(set(self.forms)) != len(self.forms):
            raise ValueError(f"forms has duplicates: {self.forms}")
        _eval_rows(*self._space(), self.eval_size)  # raises if the space is too small
        return self

    def problem(self, i: int) -> dict[str, str]:
        """Training problem ``i``: deterministic in ``(config, i)``, never a held-out problem."""
        if i < 0:
            raise ValueError(f"problem index must be >= 0, got {i}")
        held_out = {row["question"] for row in _eval_rows(*self._space(), self.eval_size)}
        rng = random.Random(f"flowrl.tool_math.train:{self.seed}:{i}")
        for _ in range(1000):
            row = _draw(rng, *self._space()[1:])
            if row["question"] not in held_out:
                return row
        raise ValueError("the problem space is (nearly) all held out: lower eval_size")

    def eval_set(self) -> list[dict[str, str]]:
        """The fixed held-out problems: distinct, and the same for the same config and seed."""
        return [dict(row) for row in _eval_rows(*self._space(), self.eval_size)]

    def _space(self) -> tuple[int, tuple[str, ...], int, int]:
        return self.seed, tuple(self.forms), self.min_operand, self.max_operand

    def train_source(self, start: int = 0) -> GeneratedSource:
        """The endless training stream ``problem(start), problem(start + 1), ...``."""
        return GeneratedSource(self.problem, start=start)

    def sft_example(self, row: dict[str, Any]) -> list[dict[str, str]]:
        """question → tool call → tool result → final answer, as the env would play it."""
        expr = row.get("expr") or row["question"].rstrip("=")
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [
            {"role": "user", "content": row["question"]},
            {"role": "assistant", "content": tool_call_text(expr)},
            {"role": "tool", "content": str(row["answer"])},  # what calculate(expr) answers
            {"role": "assistant", "content": str(row["answer"])},
        ]

    def make_env(self) -> ToolMathEnv:
        return ToolMathEnv(
            system_prompt=self.system_prompt,
            max_tool_calls=self.max_tool_calls,
            correct_reward=self.correct_reward,
            format_reward=self.format_reward,
            tool_latency=(self.tool_latency_median_s, self.tool_latency_p99_s),
        )


def _draw(rng: random.Random, forms: tuple[str, ...], low: int, high: int) -> dict[str, str]:
    """One problem. The answer is computed here, not by the calculator: generating data must
    never depend on the tool's wall-clock limit."""
    form = rng.choice(forms)
    a, b, c = (rng.randint(low, high) for _ in range(3))
    expr, answer = (f"{a}*{b}", a * b) if form == "a*b" else (f"{a}+{b}*{c}", a + b * c)
    return {"question": f"{expr}=", "answer": str(answer), "expr": expr}


@lru_cache(maxsize=16)
def _eval_rows(
    seed: int, forms: tuple[str, ...], low: int, high: int, size: int
) -> tuple[dict[str, str], ...]:
    """``size`` distinct held-out problems, cached by what determines them. A space with fewer
    than twice ``size`` problems is refused at once (drawing would cost seconds of CPU)."""
    n = high - low + 1
    space = sum(n ** len(set(re.findall(r"[a-z]", form))) for form in forms)
    if space < 2 * size:
        raise ValueError(
            f"eval_size {size} needs at least {2 * size} distinct problems; these forms and "
            f"operands {low}..{high} have {space}: widen the operand range or lower eval_size"
        )
    rng = random.Random(f"flowrl.tool_math.eval:{seed}")
    rows: dict[str, dict[str, str]] = {}
    for _ in range(size * 50):
        row = _draw(rng, forms, low, high)
        rows.setdefault(row["question"], row)
        if len(rows) == size:
            return tuple(rows.values())
    raise ValueError(f"cannot draw {size} distinct problems: widen the operand range")
