"""A shared base-model worker: one process holds a base model once, frozen, and the LoRA
adapters of many jobs (its tenants), each with its own optimiser, step count and RNG.

``backends.actors.SharedPolicy`` is a tenant's placement: the tenant's sampler and trainer are
an ``HFSampler`` and a ``TorchTrainer`` built on the worker's model, each with an adapter of its
own (the sampler's holds the weights of the last sync, so sampling one step off policy sees
the weights it should). Every verb runs with its tenant's adapter active and its tenant's RNG
state in torch's global generator, so what a tenant computes does not depend on the others:
its sampled tokens and log-probs on fixed prompts are bit-identical whether or not another
tenant trains in between (fp32, CPU). A weight sync is a copy inside the process.

The worker is a detached, named Ray actor (``shared-<hash of base, precision, device>``):
it outlives the job that started it, the next job on the same base joins it without a
restart, and once it has had no tenant for ``idle_timeout_s`` it ends, giving back the GPU
slots it holds (once, for all its tenants). A tenant whose job was killed without leaving is
dropped after ``stale_after_s`` without a call.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
import torch
from peft import get_peft_model

from flowrl.backends.hf_workers import HFSampler, TorchTrainer, _device, lora_config
from flowrl.backends.models import load_causal_lm, load_tokenizer, resolve_model_uri
from flowrl.backends.precision import forward_autocast
from flowrl.backends.types import WorkerSpec


@dataclass
class _Tenant:
    """One tenant: its two adapters (by role), its workers, its RNG and bookkeeping."""

    adapters: dict[str, str]
    workers: dict[str, Any]
    specs: dict[str, WorkerSpec]
    rng: torch.Tensor
    joined: float
    last_call: float = field(default_factory=time.monotonic)
    calls: int = 0


class SharedWorker:
    """The Ray actor of a shared base model (see the module's docstring). ``base`` is the
    worker's spec: the base model, cache folder, device and precision; ``gpus`` slots of the
    scheduler's ``gpu`` limit are held while it lives (0: none)."""

    def __init__(
        self,
        base: WorkerSpec,
        gpus: int = 0,
        idle_timeout_s: float = 120.0,
        stale_after_s: float = 900.0,
    ):
        self._slots = contextlib.ExitStack()
        if gpus > 0:
            from flowrl.infra.scheduler import gpu_slots

            self._slots.enter_context(gpu_slots(gpus))
        torch.set_num_threads(base.torch_threads)
        self.spec = base
        self.device = _device(base)
        self.path = resolve_model_uri(base.model_uri, base.cache_dir)
        # float32 master weights: the trainers' precision; samplers autocast to the spec's.
        self.base = load_causal_lm(self.path, torch.float32).to(self.device)
        self.base.requires_grad_(False)
        self.tokenizer = load_tokenizer(self.path)
        self.model: Any = None  # the PeftModel, once the first adapter is added
        self.tenants: dict[str, _Tenant] = {}
        self.events: list[tuple[str, str, float]] = []  # (tenant, joined|left|dropped, time)
        self.join_s: dict[str, float] = {}  # how long each tenant's join took
        self.idle_timeout_s = idle_timeout_s
        self.stale_after_s = stale_after_s
        self.started = time.time()
        self.base_loads = 1
        self._idle_since = time.monotonic()
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="shared-idle", daemon=True).start()

    # ------------------------------------------------------------------------ tenants

    def join(self, tenant: str, specs: dict[str, WorkerSpec]) -> float:
        """Add ``tenant`` with a sampler and a trainer built from ``specs`` (by role; LoRA on
        this worker's base); the seconds it took. A tenant of that name joins again afresh."""
        began = time.monotonic()
        with self._lock:
            for spec in specs.values():
                self._check(spec)
            self._drop(tenant, "left")
            adapters = {role: f"{_safe(tenant)}-{role}" for role in specs}
            with torch.random.fork_rng(devices=[]):  # the tenants' streams stay as they are
                for role, spec in specs.items():
                    # Both roles start from the same adapter weights (seeded).
                    torch.manual_seed(spec.seed)
                    self._add_adapter(adapters[role], spec)
                workers = {}
                for role, cls in (("sampler", HFSampler), ("trainer", TorchTrainer)):
                    self.model.set_adapter(adapters[role])
                    loaded = (self.model, self.tokenizer, self.path)
                    workers[role] = cls(specs[role], loaded, adapters[role])
                torch.manual_seed(specs["trainer"].seed)
                rng = torch.get_rng_state()
            now = time.monotonic()
            self.tenants[tenant] = _Tenant(adapters, workers, dict(specs), rng, now, now)
            self.events.append((tenant, "joined", time.time()))
            self.join_s[tenant] = time.monotonic() - began
        return self.join_s[tenant]

    def leave(self, tenant: str) -> bool:
        """Remove ``tenant``'s adapters and workers (idempotent); True if it was here."""
        with self._lock:
            return self._drop(tenant, "left")

    def call_as(self, tenant: str, role: str, verb: str, *args: Any, **kwargs: Any) -> Any:
        """``verb`` of ``tenant``'s ``role`` worker, with its adapter active and its RNG."""
        with self._lock:
            t = self._tenant(tenant)
            self.model.set_adapter(t.adapters[role])
            self.model.train(role == "trainer")
            torch.set_num_threads(t.specs[role].torch_threads)
            worker = t.workers[role]
            torch.set_rng_state(t.rng)
            try:
                with (
                    forward_autocast(worker.dtype, self.device)
                    if role == "sampler"
                    else (contextlib.nullcontext())
                ):
                    return getattr(worker, verb)(*args, **kwargs)
            finally:
                t.rng = torch.get_rng_state()
                t.last_call = time.monotonic()
                t.calls += 1

    def sync(self, tenant: str) -> int:
        """``tenant``'s trainer weights into its sampler (a copy in this process)."""
        weights = self.call_as(tenant, "trainer", "get_weights")
        return self.call_as(tenant, "sampler", "set_weights", weights)

    def restart(self, tenant: str, specs: dict[str, WorkerSpec]) -> bool:
        """``tenant`` built again from ``specs`` (``join`` afresh); always True."""
        self.join(tenant, specs)
        return True

    def where(self) -> tuple[str, int]:
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def stats(self) -> dict[str, Any]:
        """What the worker holds: its tenants (calls each), its pid, base loads, events (joins
        and leaves) and each join's seconds."""
        with self._lock:
            tenants = {name: t.calls for name, t in self.tenants.items()}
        return {
            "tenants": tenants,
            "pid": os.getpid(),
            "base_loads": self.base_loads,
            "events": list(self.events),
            "join_s": dict(self.join_s),
            "started": self.started,
            "base_path": self.path,
        }

    # ----------------------------------------------------------------------- internals

    def _check(self, spec: WorkerSpec) -> None:
        if not spec.lora.enabled:
            raise ValueError("a shared worker's tenants train LoRA adapters (model.lora)")
        if spec.model_uri != self.spec.model_uri:
            raise ValueError(
                f"this shared worker holds {self.spec.model_uri!r}, not {spec.model_uri!r}"
            )

    def _add_adapter(self, name: str, spec: WorkerSpec) -> None:
        config = lora_config(spec)
        if self.model is None:
            self.model = get_peft_model(self.base, config, adapter_name=name).to(self.device)
        else:
            self.model.add_adapter(name, config)
            self.model.to(self.device)

    def _tenant(self, tenant: str) -> _Tenant:
        try:
            return self.tenants[tenant]
        except KeyError:
            raise KeyError(
                f"{tenant!r} is not a tenant of this shared worker (it left, or was dropped "
                f"after {self.stale_after_s:.0f} s without a call)"
            ) from None

    def _drop(self, tenant: str, why: str) -> bool:
        t = self.tenants.pop(tenant, None)
        if t is None:
            return False
        for adapter in t.adapters.values():
            self.model.delete_adapter(adapter)
        self.events.append((tenant, why, time.time()))
        if not self.tenants:
            self._idle_since = time.monotonic()
        return True

    def _watch(self) -> None:
        """Drop stale tenants; end the worker once it has been idle ``idle_timeout_s``."""
        handle = ray.get_runtime_context().current_actor
        while True:
            time.sleep(min(1.0, self.idle_timeout_s / 4))
            with self._lock:
                now = time.monotonic()
                for name, t in list(self.tenants.items()):
                    if now - t.last_call > self.stale_after_s:
                        self._drop(name, "dropped")
                idle = not self.tenants and now - self._idle_since > self.idle_timeout_s
            if idle:
                handle.do.remote("exit_if_idle")
                return

    def exit_if_idle(self) -> None:
        """End the actor (its GPU slots given back) unless a tenant joined meanwhile."""
        with self._lock:
            if self.tenants:
                threading.Thread(target=self._watch, name="shared-idle", daemon=True).start()
                return
            self._slots.close()
        ray.actor.exit_actor()


def _safe(name: str) -> str:
    """An adapter name PEFT accepts (no dots: they are module paths)."""
    return name.replace(".", "_").replace(":", "_")
