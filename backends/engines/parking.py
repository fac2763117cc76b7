"""Parking a tenant's trainable tensors on disk and restoring them exactly, for every shared
base model: the rl-train tenants of a shared worker (``backends.engines.shared_worker``, its
``resident`` limit) and the Tinker API's models (``backends.engines.tinker.model.SharedBase``, its
``resident`` limit) park the same way, in one format.

The format: one safetensors file, its keys ``data:<param>`` (the values), ``grad:<param>`` (an
accumulated gradient, when there is one) and ``optim:<param>/<state key>`` (the optimiser's
tensors for that parameter: AdamW's ``step``, ``exp_avg``, ``exp_avg_sq``), ``<param>`` the
parameter's name in the model. Parking empties the tensors in memory (and the optimiser's);
restoring fills them again bit for bit, so the tenant's next step is the one it would have
taken never parked. The optimiser's ``step`` stays on the CPU, as AdamW keeps it, and each
parameter's optimiser state comes back in the order it had (the file's metadata
``optim_keys``), so a saved optimiser is byte-identical too.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def park(
    params: dict[str, torch.nn.Parameter], optimizer: torch.optim.Optimizer | None, path: str
) -> None:
    """Write ``params`` (values, gradients, ``optimizer``'s state) to ``path``; empty them."""
    out: dict[str, torch.Tensor] = {}
    order: dict[str, list[str]] = {}
    for name, param in params.items():
        out[f"data:{name}"] = param.data.to("cpu", copy=True)
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        if param.grad is not None:
            out[f"grad:{name}"] = param.grad.to("cpu", copy=True)
            param.grad = None
        state = optimizer.state.get(param, {}) if optimizer is not None else {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out[f"optim:{name}/{key}"] = value.to("cpu", copy=True)
                state[key] = torch.empty(0, dtype=value.dtype)
                order.setdefault(name, []).append(key)
    save_file(out, path, metadata={"optim_keys": json.dumps(order)})


def unpark(
    params: dict[str, torch.nn.Parameter],
    optimizer: torch.optim.Optimizer | None,
    path: str,
    device: torch.device | str,
) -> None:
    """Fill ``params`` (and ``optimizer``'s state, created if it is a fresh optimiser) from
    the file ``park`` wrote, onto ``device``; the file is removed."""
    with safe_open(path, framework="pt") as parked:
        order = json.loads((parked.metadata() or {}).get("optim_keys", "{}"))
        for key in parked.keys():  # noqa: SIM118 - a safetensors file, not a dict
            kind, _, name = key.partition(":")
            if kind == "grad":
                params[name].grad = parked.get_tensor(key).to(device, copy=True)
            elif kind == "data":
                params[name].data = parked.get_tensor(key).to(device, copy=True)
        for name, keys in order.items():
            if optimizer is None:
                break
            state = optimizer.state[params[name]]
            for state_key in keys:
                value = parked.get_tensor(f"optim:{name}/{state_key}")
                on = "cpu" if state_key == "step" else device  # each its own storage
                # interned, as the optimiser's own keys are: a saved state pickles the same
                state[sys.intern(state_key)] = value.to(on, copy=True)
    os.unlink(path)
