"""A safe arithmetic evaluator for the calculator tool: never ``eval``/``exec``.

``evaluate("12*34")`` parses with ``ast.parse(mode="eval")`` and walks an allow-list:
numbers written in ASCII digits (ints, floats with a ``.``), the binary operators
``+ - * / // % **``, unary ``+``/``-`` and parentheses. Everything else is refused with a
``CalculatorError`` whose message says why, before any work is done:

- the text: at most ``MAX_EXPR_CHARS`` characters, drawn only from ``ALLOWED_CHARS`` (so no
  names, attributes, calls, strings, lambdas, comprehensions, non-ASCII digits, ``_`` or ``e``);
- the tree: at most ``MAX_NODES`` nodes and ``MAX_DEPTH`` levels (measured without recursion);
- the values: every literal and intermediate result has ``|x| <= MAX_MAGNITUDE``; a power is
  checked BEFORE it is computed (``|exponent| <= MAX_EXPONENT`` and the result's size estimated
  from logarithms), so ``9**9**9`` costs nothing; NaN, infinity and complex results are refused;
- time: the walk checks a wall-clock deadline (``timeout_s``) at every node.

Results are formatted by ``format_number``: ints as digits, floats with 12 significant digits
(an integral float such as ``12/4`` prints as ``3``).
"""

from __future__ import annotations

import ast
import math
import operator
import time
from collections.abc import Callable

MAX_EXPR_CHARS = 200
"""Longest expression accepted, in characters."""
MAX_NODES = 100
"""Most AST nodes in one expression."""
MAX_DEPTH = 32
"""Deepest AST nesting accepted."""
MAX_EXPONENT = 64
"""Largest ``|exponent|`` of a power."""
MAX_MAGNITUDE = 10**30
"""Largest absolute value of any literal or intermediate result."""
DEFAULT_TIMEOUT_S = 1.0
"""Wall-clock budget of one evaluation. The bounds above already keep an evaluation to
microseconds; this is a backstop, generous because a loaded machine can stall a process."""
ALLOWED_CHARS = frozenset("0123456789.+-*/%() ")
"""The only characters an expression may contain."""

Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY: dict[type[ast.unaryop], Callable[[Number], Number]] = {
    ast.UAdd: operator.pos,
    ast.USub: operator.neg,
}


class CalculatorError(ValueError):
    """The expression was refused or could not be evaluated; the message says why."""


def evaluate(expr: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> Number:
    """The value of the arithmetic expression ``expr``, or ``CalculatorError``."""
    tree = _parse(expr)
    deadline = time.monotonic() + timeout_s
    return _eval(tree.body, deadline)


def calculate(expr: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """``evaluate`` formatted as text (see ``format_number``)."""
    return format_number(evaluate(expr, timeout_s))


def format_number(value: Number) -> str:
    """Digits of an int; a float with 12 significant digits, integral floats without ``.0``."""
    if isinstance(value, int):
        return str(value)
    if value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return format(value, ".12g")


def _parse(expr: object) -> ast.Expression:
    if not isinstance(expr, str):
        raise CalculatorError(f"expression must be a string, got {type(expr).__name__}")
    if len(expr) > MAX_EXPR_CHARS:
        raise CalculatorError(f"expression too long ({len(expr)} > {MAX_EXPR_CHARS} characters)")
    if not expr.strip():
        raise CalculatorError("empty expression")
    bad = sorted({c for c in expr if c not in ALLOWED_CHARS})
    if bad:
        shown = " ".join(repr(c) for c in bad[:5])
        raise CalculatorError(
            f"characters not allowed: {shown} (only ASCII digits, '.', + - * / // % ** and "
            "parentheses)"
        )
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as exc:
        raise CalculatorError(f"not a valid expression: {type(exc).__name__}") from None
    _check_shape(tree)
    return tree


def _check_shape(tree: ast.Expression) -> None:
    """Node count and depth, measured iteratively (a deep tree cannot blow the stack here)."""
    count = 0
    stack: list[tuple[ast.AST, int]] = [(tree.body, 1)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise CalculatorError(f"expression too large (more than {MAX_NODES} nodes)")
        if depth > MAX_DEPTH:
            raise CalculatorError(f"expression nested too deeply (more than {MAX_DEPTH} levels)")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(node))


def _eval(node: ast.AST, deadline: float) -> Number:
    if time.monotonic() > deadline:
        raise CalculatorError("evaluation took too long")
    if isinstance(node, ast.Constant):
        value = node.value
        if type(value) not in (int, float):  # bool, complex, str, bytes, None, Ellipsis
            raise CalculatorError(f"only numbers are allowed, got {type(value).__name__}")
        return _checked(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _checked(_UNARY[type(node.op)](_eval(node.operand, deadline)))
    if isinstance(node, ast.BinOp) and (type(node.op) in _BINARY or isinstance(node.op, ast.Pow)):
        left, right = _eval(node.left, deadline), _eval(node.right, deadline)
        if isinstance(node.op, ast.Pow):
            return _power(left, right)
        try:
            return _checked(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise CalculatorError("division by zero") from None
        except OverflowError:
            raise CalculatorError("result too large") from None
    raise CalculatorError(f"{type(node).__name__} is not allowed (only arithmetic on numbers)")


def _power(base: Number, exponent: Number) -> Number:
    """``base ** exponent`` after bounding the exponent and the result's size beforehand."""
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"exponent too large (|{exponent}| > {MAX_EXPONENT})")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero (zero to a negative power)")
    if base != 0 and exponent * math.log10(abs(base)) > math.log10(MAX_MAGNITUDE):
        raise CalculatorError(f"result too large (more than {MAX_MAGNITUDE:.0e})")
    try:
        result = base**exponent
    except (OverflowError, ZeroDivisionError) as exc:
        raise CalculatorError(f"cannot compute the power: {type(exc).__name__}") from None
    if isinstance(result, complex):
        raise CalculatorError("result is not a real number")
    return _checked(result)


def _checked(value: Number) -> Number:
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("result is not a finite number")
    if abs(value) > MAX_MAGNITUDE:
        raise CalculatorError(f"number too large (more than {MAX_MAGNITUDE:.0e})")
    return value
