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
import tempfile
import time
from typing import Any

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


class Residency:
    """A shared worker's tenants in memory (``SharedWorker``'s ``resident`` limit): at most
    ``resident`` keep their tensors there (0: all); a call of a parked tenant first parks the
    least recently used resident one to a file in the worker's model cache, then restores its
    own exactly (``park`` / ``unpark``)."""

    def __init__(self, worker: Any, resident: int):
        self.worker = worker  # its ``tenants``, ``model`` (the PeftModel), ``device``, ``spec``
        self.resident = resident
        self.parks = 0  # tenants parked on disk so far (each restored on its next call)
        self._dir: str | None = None  # made when the first tenant is parked

    def unpark(self, t: Any, keep: set[str] = frozenset()) -> None:
        """``t``'s tensors back in memory, exactly as parked, once others are parked to make
        room (``make_room``)."""
        t.last_call = time.monotonic()
        if not t.parked:
            return
        self.make_room(t, keep)
        unpark(self._tensors(t), t.workers["trainer"].optimizer, t.parked, self.worker.device)
        t.parked = None

    def make_room(self, t: Any | None, keep: set[str] = frozenset()) -> None:
        """Park the least recently used tenants in memory (not ``t``, nor those in ``keep``)
        until ``t`` fits among ``resident`` tenants in memory."""
        if not self.resident:
            return
        others = [u for u in self.worker.tenants.values() if u is not t and not u.parked]
        movable = sorted((u for u in others if u.name not in keep), key=lambda u: u.last_call)
        for u in movable[: max(0, len(others) + 1 - self.resident)]:
            self._park(u)

    def _park(self, t: Any) -> None:
        """``t``'s adapters, gradients and optimiser state to a file; its tensors emptied."""
        if self._dir is None:  # in the worker's model cache: room for the adapters
            os.makedirs(self.worker.spec.cache_dir, exist_ok=True)
            self._dir = tempfile.mkdtemp(prefix="parked-", dir=self.worker.spec.cache_dir)
        name = next(iter(t.adapters.values())).replace(".", "_").replace(":", "_")
        t.parked = os.path.join(self._dir, f"{name}.st")
        park(self._tensors(t), t.workers["trainer"].optimizer, t.parked)
        self.parks += 1

    def _tensors(self, t: Any) -> dict[str, torch.nn.Parameter]:
        """``t``'s adapter parameters by name (its two adapters: sampler's and trainer's)."""
        marks = tuple(f".{adapter}." for adapter in t.adapters.values())
        named = self.worker.model.named_parameters()
        return {n: p for n, p in named if any(m in n for m in marks)}
