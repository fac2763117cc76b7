"""The calculator tool's safe evaluator: right answers, and every hostile input refused fast and
without side effects."""

from __future__ import annotations

import sys
import time

import pytest

from flowrl.environments.calculator import (
    MAX_EXPR_CHARS,
    CalculatorError,
    calculate,
    evaluate,
    format_number,
)
from flowrl.environments.tool_math import ToolMathEnv, tool_call_text

SENTINEL = "/tmp/flowrl-calculator-sentinel"


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("47*86", "4042"),
        ("12+34*2", "80"),  # precedence
        ("(12+34)*2", "92"),
        ("7//2", "3"),
        ("7%3", "1"),
        ("-7//2", "-4"),
        ("12/4", "3"),  # an integral float prints without ".0"
        ("1/4", "0.25"),
        ("2**10", "1024"),
        ("2**-2", "0.25"),
        ("-3**2", "-9"),
        ("+5 - -5", "10"),
        ("1.5*2", "3"),
        (" 3 * ( 2 + 1 ) ", "9"),
        ("10**30", "1" + "0" * 30),  # the largest magnitude allowed
        ("(" * 90 + "1" + ")" * 90, "1"),  # parentheses alone add no nesting
    ],
)
def test_arithmetic_is_right(expr, expected):
    assert calculate(expr) == expected


def test_format_number():
    assert format_number(3) == "3" and format_number(2.5) == "2.5"
    assert format_number(1 / 3) == "0.333333333333"


HOSTILE = [
    # imports, names, attribute access, dunders, calls
    "__import__('os').system('touch " + SENTINEL + "')",
    "__import__('antigravity')",
    "import os",
    "os.system('touch " + SENTINEL + "')",
    "open('" + SENTINEL + "', 'w')",
    "().__class__.__bases__[0].__subclasses__()",
    "(1).__class__",
    "1 .real",
    "__builtins__",
    "x",
    "True + 1",
    "None",
    "print(1)",
    "abs(-1)",
    "eval('1+1')",
    "exec('x=1')",
    # lambdas, comprehensions, containers, strings, other syntax
    "lambda: 1",
    "[x for x in range(10**9)]",
    "{1: 2}",
    "(1, 2)",
    "[1, 2]",
    "'1' * 10**9",
    "b'1'",
    "1 if 1 else 0",
    "1 < 2",
    "1 & 2",
    "1 << 100",
    "~1",
    "not 1",
    "(x := 1)",
    "1; 2",
    "1j",
    "1e308 * 10",
    "1_000",
    # huge powers, big ints, deep nesting, long strings
    "9**9**9",
    "2**65",
    "10**31",
    "99999999999999999999999999999999999*99999999999",
    "(2**64)**64",
    "9" * 40,
    "1" + "*1" * 99 + "*1",
    "(" * 60 + "1" + "+1)" * 60,  # 60 nested additions
    "-" * 150 + "1",
    "1+" * 120 + "1",
    "1" * (MAX_EXPR_CHARS + 1),
    "1+1" + " " * 10_000,
    # NaN, inf, non-ASCII digits, non-numbers
    "float('nan')",
    "float('inf')",
    "nan",
    "inf",
    "\u0663",  # Arabic-Indic three
    "\u0663+1",
    "\uff11+1",  # full-width one
    "1\u00a0+ 1",  # no-break space
    "\x00",
    "",
    "   ",
    # errors of arithmetic
    "1/0",
    "1//0",
    "1%0",
    "0**-1",
    "(-8)**0.5",
    "1.5**64.5",
]


@pytest.mark.parametrize("expr", HOSTILE)
def test_hostile_input_is_refused_fast_without_side_effects(expr, tmp_path):
    modules_before = set(sys.modules)
    start = time.monotonic()
    with pytest.raises(CalculatorError) as caught:
        evaluate(expr)
    elapsed = time.monotonic() - start
    assert elapsed < 1.0
    assert str(caught.value)  # an explanation, never an empty message
    assert not _exists(SENTINEL)
    assert set(sys.modules) == modules_before  # nothing was imported


def test_hostile_inputs_are_many_and_distinct():
    assert len(set(HOSTILE)) >= 30


@pytest.mark.parametrize("expr", HOSTILE[:10] + ["9**9**9", "\u0663", "1/0"])
def test_hostile_call_becomes_an_error_observation(expr):
    env = ToolMathEnv()
    env.reset(question="1+1=", answer="2")
    start = time.monotonic()
    result = env.step(tool_call_text(expr))
    assert time.monotonic() - start < 1.0
    assert result.observation.startswith("error: ") and not result.done
    assert result.info["tool_errors"] == 1 and result.info["observation_role"] == "tool"
    assert not _exists(SENTINEL)


def test_non_string_is_refused():
    with pytest.raises(CalculatorError, match="string"):
        evaluate(12)  # type: ignore[arg-type]


def test_refusals_explain_themselves():
    with pytest.raises(CalculatorError, match="exponent too large"):
        evaluate("2**65")
    with pytest.raises(CalculatorError, match="too large"):
        evaluate("9**9**9")
    with pytest.raises(CalculatorError, match="division by zero"):
        evaluate("1/0")
    with pytest.raises(CalculatorError, match="not allowed"):
        evaluate("__import__('os')")
    with pytest.raises(CalculatorError, match="too long"):
        evaluate("1" * 201)
    with pytest.raises(CalculatorError, match="nested too deeply|too large"):
        evaluate("-" * 150 + "1")


def _exists(path: str) -> bool:
    import os

    return os.path.exists(path)


def test_wall_clock_limit_is_enforced():
    with pytest.raises(CalculatorError, match="took too long"):
        evaluate("1+2*3", timeout_s=-1.0)  # a deadline already past
    assert evaluate("1+2*3") == 7
