"""Custom losses a Tinker client uploads (``ServiceClient.create_custom_loss``), rebuilt from
plain data and run from an allow-list only.

The SDK traces the client's loss with ``torch.fx`` and sends its graph as data: one node per
operation, each naming its target by a string (``torch.exp``, ``operator.mul``, a tensor method
``sum``) with its encoded arguments (``CustomLossGraph``). Nothing in it is executable. This
module rebuilds it from its own tables: a node whose target is not in them (``os.system``,
``builtins.eval``, ``torch.load``, a module, a captured tensor, a tensor method such as
``tolist`` that leaves torch) is refused with a ``TinkerInputError`` naming the node and the
target; so are arguments of a kind the wire does not define, Python number arithmetic that would
grow without bound, and graphs past ``MAX_NODES``. What runs is a loop over the nodes that calls
the allowed functions on tensors: no ``eval``, no import, no attribute lookup by a name from the
request (``getattr`` reads only ``shape``, ``ndim`` and ``dtype``).

A loss runs once per datum, on that datum's log-probs (``[T]``) and the ``loss_fn_inputs`` it
names (each ``[T]``: 1-D inputs, the rank this server's data take), and returns a scalar loss
and scalar metrics named ``custom/<name>:sum`` or ``custom/<name>:mean``.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own name for it

from flowrl.backends.engines.tinker.types import TinkerInputError

MAX_NODES = 512
MAX_DEPTH = 8
MAX_INPUTS = 16
MAX_EXPONENT = 64
"""The largest exponent of a power of two Python numbers (a bigger one can take the machine)."""
METRIC = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")

_TORCH = {
    name: getattr(torch, name)
    for name in (
        "abs", "add", "clamp", "clip", "cumsum", "div", "exp", "expm1", "flatten", "full_like",
        "log", "log1p", "log_softmax", "logsumexp", "maximum", "mean", "minimum", "mul", "neg",
        "ones_like", "pow", "relu", "rsqrt", "sigmoid", "sign", "softmax", "sqrt", "square",
        "stack", "cat", "sub", "sum", "tanh", "where", "zeros_like", "gather", "amax", "amin",
        "logaddexp", "clamp_min", "clamp_max", "exp2", "reciprocal",
    )
}  # fmt: skip
_FUNCTIONS: dict[str, Callable[..., Any]] = {
    **{f"torch.{name}": fn for name, fn in _TORCH.items()},
    **{
        f"torch.nn.functional.{name}": getattr(F, name)
        for name in ("logsigmoid", "softplus", "relu", "sigmoid", "log_softmax", "softmax")
    },
    # torch.fx names these two by where they live: the wire gives that name
    "torch._C._nn.log_sigmoid": F.logsigmoid,
    "torch._C._nn.softplus": F.softplus,
    **{
        f"operator.{name}": getattr(operator, name)
        for name in (
            "add", "sub", "mul", "truediv", "neg", "pos", "pow", "getitem", "lt", "le", "gt",
            "ge", "eq", "ne", "and_", "or_", "invert", "floordiv", "mod",
        )
    },
    **{f"math.{name}": getattr(math, name) for name in ("exp", "log", "log1p", "sqrt", "tanh")},
}  # fmt: skip
"""What a ``call_function`` node may call, by the name the wire gives it."""
_METHODS = frozenset(
    {
        "abs", "add", "amax", "amin", "clamp", "clamp_max", "clamp_min", "clip", "cumsum",
        "detach", "div", "exp", "expm1", "flatten", "float", "double", "gather", "log",
        "log1p", "log_softmax", "logsumexp", "masked_fill", "max", "mean", "min", "mul", "neg",
        "pow", "relu", "reshape", "rsqrt", "sigmoid", "sign", "size", "softmax", "sqrt",
        "square", "squeeze", "sub", "sum", "tanh", "unsqueeze", "view", "where", "reciprocal",
        "exp2", "__getitem__", "__add__", "__sub__", "__mul__", "__truediv__", "__neg__",
        "__pow__", "__rsub__", "__radd__", "__rmul__", "__rtruediv__",
    }
)  # fmt: skip
"""The tensor methods a ``call_method`` node may call (none that leaves torch or allocates by a
size the request gives)."""
_ATTRIBUTES = frozenset({"shape", "ndim", "dtype"})
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bool": torch.bool}


@dataclass(frozen=True)
class CustomLoss:
    """A checked loss graph: its name, inputs (``logprobs`` first) and nodes."""

    name: str
    inputs: tuple[str, ...]
    nodes: tuple[dict[str, Any], ...]

    def __call__(self, *values: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the graph on one datum's ``values`` (in ``inputs``' order)."""
        env: dict[str, Any] = {}
        placeholders = iter(values)
        for node in self.nodes:
            op, name = node["op"], node["name"]
            if op == "placeholder":
                env[name] = next(placeholders)
                continue
            args = [_value(a, env, node) for a in node.get("args", [])]
            kwargs = {k: _value(v, env, node) for k, v in node.get("kwargs", {}).items()}
            if op == "output":
                loss, metrics = args[0]
                return loss, metrics
            env[name] = _call(node, args, kwargs)
        raise TinkerInputError(f"custom loss {self.name!r}: its graph has no output")


def compile_loss(
    name: str, inputs: list[Mapping[str, Any]], graph: Mapping[str, Any]
) -> CustomLoss:
    """The loss that ``graph`` (a ``CustomLossGraph`` as JSON) describes, checked against the
    allow-list; a ``TinkerInputError`` naming the first thing refused."""
    where = f"custom loss {str(name)[:64]!r}"
    if not isinstance(graph, Mapping) or graph.get("format") != 1:
        raise TinkerInputError(f"{where}: graph format must be 1")
    nodes = graph.get("nodes")
    if not isinstance(nodes, list) or not nodes or len(nodes) > MAX_NODES:
        raise TinkerInputError(f"{where}: a graph has 1 to {MAX_NODES} nodes")
    names = _input_names(where, inputs)
    seen: set[str] = set()
    placeholders: list[str] = []
    for node in nodes:
        if not isinstance(node, Mapping) or not isinstance(node.get("name"), str):
            raise TinkerInputError(f"{where}: a node is not an object with a name")
        _check_node(f"{where}, node {node['name'][:64]!r}", node, seen)
        if node.get("op") == "placeholder":
            placeholders.append(str(node.get("target")))
        seen.add(node["name"])
    outputs = sum(node.get("op") == "output" for node in nodes)
    if placeholders != list(names) or outputs != 1 or nodes[-1].get("op") != "output":
        raise TinkerInputError(f"{where}: the graph must take {list(names)} and end in one output")
    return CustomLoss(str(name), names, tuple(dict(n) for n in nodes))


def _check_node(where: str, node: Mapping[str, Any], seen: set[str]) -> None:
    """One node: an allowed kind and target, arguments of the wire's forms that refer only to
    earlier nodes."""
    op, target = node.get("op"), node.get("target")
    if op == "call_function" and target not in _FUNCTIONS and target != "builtins.getattr":
        raise TinkerInputError(f"{where}: {str(target)[:80]!r} is not allowed")
    if op == "call_method" and target not in _METHODS:
        raise TinkerInputError(f"{where}: method {str(target)[:80]!r} is not allowed")
    if op not in ("placeholder", "call_function", "call_method", "output"):
        raise TinkerInputError(f"{where}: {str(op)[:40]!r} nodes are not allowed")
    if op == "output":
        _check_output(where, node)
    for arg in [*node.get("args", []), *dict(node.get("kwargs", {})).values()]:
        _check_arg(where, arg, seen, 0)
    if target == "builtins.getattr":
        _check_getattr(where, node)


def _input_names(where: str, inputs: list[Mapping[str, Any]]) -> tuple[str, ...]:
    if not isinstance(inputs, list) or not 1 <= len(inputs) <= MAX_INPUTS:
        raise TinkerInputError(f"{where}: 1 to {MAX_INPUTS} inputs")
    names = []
    for entry in inputs:
        name, rank = entry.get("name"), entry.get("rank")
        if not isinstance(name, str) or not INPUT_NAME.fullmatch(name):
            raise TinkerInputError(f"{where}: bad input name {str(name)[:64]!r}")
        if rank != 1:
            raise TinkerInputError(
                f"{where}: input {name!r} has rank {rank}; this server takes 1-D inputs only "
                "(rank 1, [T])"
            )
        names.append(name)
    if names[0] != "logprobs" or len(set(names)) != len(names):
        raise TinkerInputError(f"{where}: inputs are logprobs, then distinct loss_fn_inputs")
    return tuple(names)


def _check_arg(where: str, arg: Any, seen: set[str], depth: int) -> None:
    if depth > MAX_DEPTH:
        raise TinkerInputError(f"{where}: arguments nest deeper than {MAX_DEPTH}")
    if arg is None or isinstance(arg, (bool, int, float)):
        return
    if isinstance(arg, str):
        if len(arg) > 128:
            raise TinkerInputError(f"{where}: a string argument is longer than 128")
        return
    if isinstance(arg, list):
        for a in arg:
            _check_arg(where, a, seen, depth + 1)
        return
    if not isinstance(arg, Mapping) or len(arg) != 1:
        raise TinkerInputError(f"{where}: an argument of an unknown form")
    _check_wrapped(where, *next(iter(arg.items())), seen, depth)


def _check_wrapped(where: str, kind: str, value: Any, seen: set[str], depth: int) -> None:
    """A one-key argument: a node's name, a container, or one of the constants allowed."""
    if kind == "ref" and value in seen:
        return
    if kind == "ref":
        raise TinkerInputError(f"{where}: it refers to {str(value)[:64]!r}, no earlier node")
    if kind in ("tuple", "slice") and isinstance(value, list):
        for a in value:
            _check_arg(where, a, seen, depth + 1)
        return
    if kind == "dict" and isinstance(value, Mapping):
        for a in value.values():
            _check_arg(where, a, seen, depth + 1)
        return
    constants = {"float": ("inf", "-inf", "nan"), "dtype": tuple(_DTYPES), "ellipsis": (True,)}
    if value not in constants.get(kind, ()):
        raise TinkerInputError(f"{where}: argument {str(kind)[:40]!r} is not allowed")


def _check_getattr(where: str, node: Mapping[str, Any]) -> None:
    args = node.get("args", [])
    if len(args) != 2 or args[1] not in _ATTRIBUTES:
        raise TinkerInputError(f"{where}: getattr reads only {sorted(_ATTRIBUTES)}")


def _check_output(where: str, node: Mapping[str, Any]) -> None:
    args = node.get("args", [])
    out = args[0] if len(args) == 1 else None
    pair = out.get("tuple") if isinstance(out, Mapping) else out
    if not isinstance(pair, list) or len(pair) != 2:
        raise TinkerInputError(f"{where}: the output is (loss, metrics)")
    metrics = pair[1].get("dict") if isinstance(pair[1], Mapping) else None
    if not isinstance(metrics, Mapping):
        raise TinkerInputError(f"{where}: the metrics are a dict")
    for key in metrics:
        if not METRIC.fullmatch(key):
            raise TinkerInputError(
                f"{where}: metric {key[:80]!r} is not custom/<name>:sum or custom/<name>:mean"
            )


def _value(arg: Any, env: dict[str, Any], node: Mapping[str, Any]) -> Any:
    """An encoded argument's value (checked by ``compile_loss``)."""
    if isinstance(arg, list):
        return [_value(a, env, node) for a in arg]
    if not isinstance(arg, Mapping):
        return arg
    ((kind, value),) = arg.items()
    if kind == "ref":
        return env[value]
    if kind == "tuple":
        return tuple(_value(a, env, node) for a in value)
    if kind == "dict":
        return {k: _value(v, env, node) for k, v in value.items()}
    if kind == "slice":
        return slice(*(_value(a, env, node) for a in value))
    if kind == "float":
        return float(value)
    if kind == "dtype":
        return _DTYPES[value]
    return Ellipsis


def _call(node: Mapping[str, Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
    target = node["target"]
    if node["op"] == "call_method":
        this, *rest = args
        if not isinstance(this, torch.Tensor):
            raise TinkerInputError(f"node {node['name'][:64]!r}: {target} of a non-tensor")
        return getattr(this, target)(*rest, **kwargs)
    if target == "builtins.getattr":
        return getattr(args[0], args[1])  # one of _ATTRIBUTES (checked)
    plain = not any(isinstance(a, torch.Tensor) for a in [*args, *kwargs.values()])
    if plain and target.startswith(("operator.", "math.")):
        _bounded(node, target, args)
    return _FUNCTIONS[target](*args, **kwargs)


def _bounded(node: Mapping[str, Any], target: str, args: list[Any]) -> None:
    """An ``operator`` or ``math`` call on Python values only: on numbers that fit a machine
    word (or indexing a shape), never a power with a huge exponent, never on strings or lists
    (``"a" * 10**12`` would take the machine)."""
    where = f"node {node['name'][:64]!r}"
    if target == "operator.getitem" and args and isinstance(args[0], tuple):
        return  # a shape's entry
    if not all(isinstance(a, (bool, int, float)) for a in args):
        kinds = ", ".join(type(a).__name__ for a in args)
        raise TinkerInputError(f"{where}: {target} of ({kinds}): numbers or tensors only")
    if any(isinstance(a, int) and abs(a) > 2**63 for a in args):
        raise TinkerInputError(f"{where}: {target} of a number past 2**63")
    if target == "operator.pow" and len(args) == 2:
        base, exponent = args
        if abs(exponent) > MAX_EXPONENT and base not in (0, 1, -1):
            raise TinkerInputError(
                f"{where}: a power of Python numbers with an exponent past {MAX_EXPONENT}"
            )


def run_custom(
    loss: CustomLoss, logprobs: list[torch.Tensor], inputs: list[list[torch.Tensor]]
) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss summed over the data (``logprobs[i]`` and ``inputs[i]``: datum ``i``'s), and
    its metrics reduced by their suffix (sum, or mean over the data)."""
    total: torch.Tensor | None = None
    sums: dict[str, float] = {}
    for lp, values in zip(logprobs, inputs, strict=True):
        try:
            out, metrics = loss(lp, *values)
        except TinkerInputError:
            raise
        except Exception as err:  # noqa: BLE001 - a loss that fails on its data is the caller's
            raise TinkerInputError(
                f"custom loss {loss.name!r} failed: {type(err).__name__}: {err}"[:400]
            ) from None
        if not isinstance(out, torch.Tensor) or out.ndim != 0:
            raise TinkerInputError(f"custom loss {loss.name!r} must return a scalar loss")
        total = out if total is None else total + out
        for key, value in metrics.items():
            number = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
            sums[key] = sums.get(key, 0.0) + number
    metrics_out = {k: v / len(logprobs) if k.endswith(":mean") else v for k, v in sums.items()}
    assert total is not None  # noqa: S101 - data are never empty (check_batch)
    return total, metrics_out
