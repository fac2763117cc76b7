"""Custom losses uploaded by Tinker clients (``backends/engines/tinker/custom_loss.py``): a loss
the SDK traces and encodes runs here with the value and gradient of the client's own function;
a graph that reaches for anything outside the allow-list is refused, naming it, before anything
runs (the SDK round trip and the service that keeps serving: ``test_tinker_api.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from flowrl.backends.engines.tinker.custom_loss import MAX_NODES, compile_loss, run_custom
from flowrl.backends.engines.tinker.types import TinkerInputError


def ppo_like(logprobs, sampler, advantages):  # noqa: ANN001, ANN201
    ratio = torch.exp(logprobs - sampler)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/loss:sum": loss}


def bradley_terry(logprobs, weights):  # noqa: ANN001, ANN201
    margin = (logprobs * weights).sum() / (weights.abs().sum() + 1.0)
    loss = -torch.nn.functional.logsigmoid(margin * 2.0) + logprobs[..., :2].pow(2).mean()
    return loss, {"custom/margin:mean": margin}


def _encoded(fn, ranks: dict) -> tuple[list[dict], dict]:  # noqa: ANN001
    handle = trace_loss(fn, ranks, session_id="s")
    inputs = [i.model_dump() for i in handle.inputs]
    return inputs, encode_graph(handle).model_dump(mode="json")


@pytest.mark.parametrize(
    ("fn", "names"),
    [(ppo_like, ["logprobs", "sampler", "advantages"]), (bradley_terry, ["logprobs", "weights"])],
)
def test_a_traced_loss_runs_as_the_clients_function(fn, names) -> None:  # noqa: ANN001
    """Loss, metrics and the gradient on the log-probs equal the function's own (<= 1e-6)."""
    inputs, graph = _encoded(fn, dict.fromkeys(names, 1))
    loss = compile_loss(fn.__name__, inputs, graph)
    gen = torch.Generator().manual_seed(0)
    data = [[torch.randn(n, generator=gen, dtype=torch.float64) for _ in names] for n in (5, 8)]
    ours = [[t.clone().requires_grad_(k == 0) for k, t in enumerate(d)] for d in data]
    theirs = [[t.clone().requires_grad_(k == 0) for k, t in enumerate(d)] for d in data]
    total, metrics = run_custom(loss, [d[0] for d in ours], [d[1:] for d in ours])
    expected = sum(fn(*d)[0] for d in theirs)
    total.backward()
    expected.backward()
    assert abs(float(total) - float(expected)) <= 1e-6
    for a, b in zip(ours, theirs, strict=True):
        assert torch.allclose(a[0].grad, b[0].grad, atol=1e-6, rtol=0)
    key = next(iter(metrics))
    per = [float(fn(*d)[1][key]) for d in data]
    want = sum(per) / len(per) if key.endswith(":mean") else sum(per)
    assert abs(metrics[key] - want) <= 1e-6


def _node(name: str, op: str, target: str, *args, **kwargs) -> dict:  # noqa: ANN002, ANN003
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}


def _graph(*middle: dict, out: str = "y") -> dict:
    nodes = [_node("logprobs", "placeholder", "logprobs"), *middle]
    result = {"tuple": [{"ref": out}, {"dict": {}}]}
    nodes.append(_node("output", "output", "output", result))
    return {"format": 1, "nodes": nodes}


LP = [{"name": "logprobs", "rank": 1}]
HOSTILE = {
    "os.system": _graph(_node("y", "call_function", "os.system", "rm -rf /")),
    "builtins.eval": _graph(_node("y", "call_function", "builtins.eval", "1+1")),
    "builtins.__import__": _graph(_node("y", "call_function", "builtins.__import__", "os")),
    "torch.load": _graph(_node("y", "call_function", "torch.load", "/etc/passwd")),
    "torch.save": _graph(_node("y", "call_function", "torch.save", {"ref": "logprobs"}, "/x")),
    "subprocess.run": _graph(_node("y", "call_function", "subprocess.run", ["ls"])),
    "method 'tolist'": _graph(_node("y", "call_method", "tolist", {"ref": "logprobs"})),
    "method '__reduce_ex__'": _graph(
        _node("y", "call_method", "__reduce_ex__", {"ref": "logprobs"}, 2)
    ),
    "method 'numpy'": _graph(_node("y", "call_method", "numpy", {"ref": "logprobs"})),
    "'get_attr' nodes": _graph(_node("y", "get_attr", "weight")),
    "'call_module' nodes": _graph(_node("y", "call_module", "linear", {"ref": "logprobs"})),
    "getattr reads only": _graph(
        _node("y", "call_function", "builtins.getattr", {"ref": "logprobs"}, "__class__")
    ),
    "no earlier node": _graph(_node("y", "call_function", "torch.exp", {"ref": "later"})),
    "argument 'device'": _graph(
        _node(
            "y", "call_function", "torch.ones_like", {"ref": "logprobs"}, device={"device": "cuda"}
        )
    ),
    "argument 'dtype'": _graph(
        _node("y", "call_function", "torch.zeros_like", {"ref": "logprobs"}, {"dtype": "int8"})
    ),
}


@pytest.mark.parametrize("why", list(HOSTILE))
def test_a_hostile_graph_is_refused_naming_what(why: str) -> None:
    with pytest.raises(TinkerInputError, match=why.replace("(", r"\(")):
        compile_loss("evil", LP, HOSTILE[why])


def test_malformed_graphs_are_refused() -> None:
    exp = _node("y", "call_function", "torch.exp", {"ref": "logprobs"})
    cases = {
        "graph format must be 1": {"format": 2, "nodes": []},
        f"1 to {MAX_NODES} nodes": {"format": 1, "nodes": [exp] * (MAX_NODES + 1)},
        "nest deeper": _graph(_node("y", "call_function", "torch.exp", [[[[[[[[[[1]]]]]]]]]])),
        "the output is \\(loss, metrics\\)": {
            "format": 1,
            "nodes": [
                _node("logprobs", "placeholder", "logprobs"),
                exp,
                _node("o", "output", "output", {"ref": "y"}),
            ],
        },
        "rank 2": None,
    }
    for why, graph in cases.items():
        inputs = [{"name": "logprobs", "rank": 2}] if graph is None else LP
        with pytest.raises(TinkerInputError, match=why):
            compile_loss("bad", inputs, graph or _graph(exp))
    bad_metric = copy.deepcopy(_graph(exp))
    bad_metric["nodes"][-1]["args"][0]["tuple"][1] = {"dict": {"loss:sum": {"ref": "y"}}}
    with pytest.raises(TinkerInputError, match="custom/<name>:sum"):
        compile_loss("bad", LP, bad_metric)


def test_python_number_arithmetic_that_would_not_end_is_refused() -> None:
    """``10 ** 10 ** 9`` on Python numbers would take the machine: refused as it is reached."""
    graph = _graph(
        _node("big", "call_function", "operator.pow", 10, 1_000_000_000),
        _node("y", "call_function", "operator.mul", {"ref": "logprobs"}, {"ref": "big"}),
    )
    loss = compile_loss("bomb", LP, graph)
    with pytest.raises(TinkerInputError, match="exponent past 64"):
        run_custom(loss, [torch.zeros(3)], [[]])


def test_python_values_that_would_grow_without_bound_are_refused() -> None:
    """``"a" * 10**12`` (a string argument times a number) is refused as it is reached."""
    graph = _graph(
        _node("big", "call_function", "operator.mul", "a", 1_000_000_000_000),
        _node("y", "call_function", "operator.mul", {"ref": "logprobs"}, 2.0),
    )
    loss = compile_loss("bomb", LP, graph)
    with pytest.raises(TinkerInputError, match="numbers or tensors only"):
        run_custom(loss, [torch.zeros(3)], [[]])
