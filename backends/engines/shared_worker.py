"""A shared base-model worker: one process holds a base model once, frozen, and the LoRA
adapters of many jobs (its tenants), each with its own optimiser, step count and RNG.

``backends.policy.actors.SharedPolicy`` is a tenant's placement: the tenant's sampler and trainer
are an ``HFSampler`` and a ``TorchTrainer`` built on the worker's model, each with an adapter of its
own (the sampler's holds the weights of the last sync, so sampling one step off policy sees
the weights it should). Every verb runs with its tenant's adapter active and its tenant's RNG
state in torch's global generator, so what a tenant computes does not depend on the others:
its sampled tokens and log-probs on fixed prompts are bit-identical whether or not another
tenant trains in between (fp32, CPU). A weight sync is a copy inside the process.

Sampling calls of several tenants that arrive while the worker is busy are answered together
(``shared_batches.Batches``): their rows go through one forward pass, each tenant's rows through
its adapter in every LoRA layer, each row with its own temperature and random stream
(``HFSampler.sample_rows``), so a tenant's draws do not depend on whose rows share the batch. A
call that arrives alone runs as a job's own sampler would, bit for bit. If a batch together
fails, each call in it runs alone, so a bad call fails only its tenant.

The worker's base and adapters are a ``engines.tinker.model.SharedBase``: Tinker API training models
(``ModelTenancy``; ``backends.policy.placement.SharedTenant``) are adapters on the same base, next
to the jobs', with the verbs and state of the Tinker API's own models.

With ``resident`` set, at most that many tenants keep their tensors in memory
(``parking.Residency``): a call of a parked tenant first parks the least recently used resident
one — its adapters, gradients and optimiser state written to the worker's disk (safetensors),
its tensors emptied — and restores its own, exactly: its next step is bit-identical to one never
parked (rl-train tenants; Tinker models stay in memory).

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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from flowrl.backends.engines.hf_model import lora_config, worker_device
from flowrl.backends.engines.hf_sampler import HFSampler
from flowrl.backends.engines.parking import Residency
from flowrl.backends.engines.shared_batches import Batches, SamplingCall
from flowrl.backends.engines.tinker.model import SharedBase, TinkerModel
from flowrl.backends.engines.torch_trainer import TorchTrainer
from flowrl.backends.models.model_folder import load_causal_lm, load_tokenizer
from flowrl.backends.models.model_uri import resolve_model_uri
from flowrl.backends.models.precision import forward_autocast
from flowrl.backends.types import JobTenancy, ModelTenancy, Tenancy, WorkerSpec


@dataclass
class _Tenant:
    """One tenant: its two adapters (by role), its workers, its RNG and bookkeeping."""

    name: str
    adapters: dict[str, str]
    workers: dict[str, Any]
    specs: dict[str, WorkerSpec]
    rng: torch.Tensor
    joined: float
    last_call: float = field(default_factory=time.monotonic)
    calls: int = 0
    parked: str | None = None  # the file its tensors are parked in (``resident``)


@dataclass
class _ModelTenant:
    """A Tinker API training model on this worker's base (``ModelTenancy``)."""

    model: TinkerModel
    last_call: float = field(default_factory=time.monotonic)
    calls: int = 0


class SharedWorker:
    """The Ray actor of a shared base model (see the module's docstring). ``base`` is the
    worker's spec: the base model, cache folder, device and precision; ``gpus`` slots of the
    scheduler's ``gpu`` limit are held while it lives (0: none). ``mix_batches``: tenants'
    concurrent sampling calls share forward passes; ``resident``: tenants whose tensors stay
    in memory at once, the others parked on disk (0: all stay; the module's docstring)."""

    def __init__(
        self,
        base: WorkerSpec,
        gpus: int = 0,
        idle_timeout_s: float = 120.0,
        stale_after_s: float = 900.0,
        mix_batches: bool = True,
        resident: int = 0,
    ):
        self._slots = contextlib.ExitStack()
        if gpus > 0:
            from flowrl.infra.scheduler import gpu_slots

            self._slots.enter_context(gpu_slots(gpus))
        torch.set_num_threads(base.torch_threads)
        self.spec = base
        self.device = worker_device(base)
        self.path = resolve_model_uri(base.model_uri, base.cache_dir)
        # float32 master weights: the trainers' precision; samplers autocast to the spec's.
        model = load_causal_lm(self.path, torch.float32).to(self.device)
        model.requires_grad_(False)
        self.tokenizer = load_tokenizer(self.path)
        # The base and its adapters, as the Tinker API's models hold theirs (engines.tinker.model).
        self.shared = SharedBase(self.path, self.device, loaded=(model, self.tokenizer))
        self.tenants: dict[str, _Tenant] = {}
        self.models: dict[str, _ModelTenant] = {}  # Tinker API models (``ModelTenancy``)
        self.events: list[tuple[str, str, float]] = []  # (tenant, joined|left|dropped, time)
        self.join_s: dict[str, float] = {}  # how long each tenant's join took
        self.idle_timeout_s = idle_timeout_s
        self.stale_after_s = stale_after_s
        self.started = time.time()
        self.base_loads = 1
        self._idle_since = time.monotonic()
        self._lock = threading.Lock()
        self._runner = ThreadPoolExecutor(1, thread_name_prefix="shared-work")
        self.mix_batches = mix_batches
        self.batches = Batches(self)  # tenants' sampling calls answered together
        self.busy_s = 0.0  # seconds the worker has spent running calls
        self.residency = Residency(self, resident)  # tenants in memory, the others parked
        threading.Thread(target=self._watch, name="shared-idle", daemon=True).start()

    # ------------------------------------------------------------------------ tenants

    def join(self, tenant: str, tenancy: Tenancy) -> dict[str, Any]:
        """Add ``tenant``: a job's sampler and trainer (``JobTenancy``) or a Tinker API
        training model (``ModelTenancy``), LoRA on this worker's base; a tenant of that name
        joins again afresh. The seconds it took (``join_s``), and for a model its vocabulary
        size and context length."""
        began = time.monotonic()
        if isinstance(tenancy, ModelTenancy):
            info = self.work(self._join_model, tenant, tenancy, began)
        else:
            info = {"join_s": self.work(self._join, tenant, tenancy.specs, began)}
        return info

    def _join(self, tenant: str, specs: dict[str, WorkerSpec], began: float) -> float:
        for spec in specs.values():
            self._check(spec)
        self._drop(tenant, "left")
        self.residency.make_room(None)
        adapters = {role: f"{safe_name(tenant)}-{role}" for role in specs}
        with torch.random.fork_rng(devices=[]):  # the tenants' streams stay as they are
            for role, spec in specs.items():
                # Both roles start from the same adapter weights (seeded).
                self.shared.add_lora(adapters[role], lora_config(spec), spec.seed)
            workers = {}
            for role, cls in (("sampler", HFSampler), ("trainer", TorchTrainer)):
                self.model.set_adapter(adapters[role])
                loaded = (self.model, self.tokenizer, self.path)
                workers[role] = cls(specs[role], loaded, adapters[role])
            torch.manual_seed(specs["trainer"].seed)
            rng = torch.get_rng_state()
        now = time.monotonic()
        self.tenants[tenant] = _Tenant(tenant, adapters, workers, dict(specs), rng, now, now)
        self.events.append((tenant, "joined", time.time()))
        self.join_s[tenant] = time.monotonic() - began
        return self.join_s[tenant]

    def leave(self, tenant: str) -> bool:
        """Remove ``tenant``, a job's or a model's (idempotent); True if it was here."""
        return self.work(self._drop, tenant, "left")

    def call_as(self, tenant: str, role: str, verb: str, *args: Any, **kwargs: Any) -> Any:
        """``verb`` of ``tenant``'s ``role`` (a job's ``sampler`` or ``trainer``; a Tinker
        model's ``model``), with its adapter active and its RNG; text sampling calls may run
        together with other tenants' (the module's docstring)."""
        model = self.models.get(tenant)
        if model is not None or role == "model":
            return self._call_model(tenant, model, role, verb, *args, **kwargs)
        if self.mix_batches and role == "sampler" and verb == "sample" and not kwargs:
            if len(args) in (3, 4):  # prompts, max_new_tokens, temperature[, seed]
                return self.batches.sample(SamplingCall(tenant, *args))
        return self.work(self.call_alone, tenant, role, verb, *args, **kwargs)

    def call_alone(self, tenant: str, role: str, verb: str, *args: Any, **kwargs: Any) -> Any:
        """``call_as`` under the worker's lock: one tenant's verb, alone."""
        t = self._tenant(tenant)
        self.residency.unpark(t)
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

    # ------------------------------------------------------------- Tinker API models

    def _join_model(self, tenant: str, tenancy: ModelTenancy, began: float) -> dict[str, Any]:
        self._drop(tenant, "left")
        model = TinkerModel(self.shared, tenancy.lora, tenancy.seed, name=tenant)
        self.models[tenant] = _ModelTenant(model)
        self.events.append((tenant, "joined", time.time()))
        self.join_s[tenant] = time.monotonic() - began
        return {
            "vocab_size": model.vocab_size,
            "context_length": model.context_length,
            "join_s": self.join_s[tenant],
        }

    def _call_model(
        self, tenant: str, t: _ModelTenant | None, role: str, verb: str, *args: Any, **kwargs: Any
    ) -> Any:
        if t is None:
            raise KeyError(f"{tenant!r} is not a model on this shared worker (unloaded)")
        if role != "model":
            raise ValueError(f"{tenant!r} is a Tinker model: its role is 'model', not {role!r}")
        t.last_call, t.calls = time.monotonic(), t.calls + 1
        return self.work(self._model_verb, t.model, verb, *args, **kwargs)

    def _model_verb(self, model: TinkerModel, verb: str, *args: Any, **kwargs: Any) -> Any:
        self.model.eval()  # Tinker's verbs: no dropout
        torch.set_num_threads(self.spec.torch_threads)
        return getattr(model, verb)(*args, **kwargs)

    def sync(self, tenant: str) -> int:
        """``tenant``'s trainer weights into its sampler (a copy in this process)."""
        return self.work(self._sync, tenant)

    def _sync(self, tenant: str) -> int:
        return self.call_alone(
            tenant, "sampler", "set_weights", self.call_alone(tenant, "trainer", "get_weights")
        )

    def restart(self, tenant: str, specs: dict[str, WorkerSpec]) -> bool:
        """A job's ``tenant`` built again from ``specs`` (``join`` afresh); always True."""
        self.join(tenant, JobTenancy(specs))
        return True

    def where(self) -> tuple[str, int]:
        return ray.get_runtime_context().get_node_id(), os.getpid()

    def stats(self) -> dict[str, Any]:
        """What the worker holds: its tenants (calls each), its pid, base loads, events (joins
        and leaves), each join's seconds, and how many calls each batch run together held."""
        with self._lock:
            tenants = {name: t.calls for name, t in self.tenants.items()}
            models = {name: t.calls for name, t in self.models.items()}
        return {
            "tenants": tenants,
            "tinker_models": models,
            "pid": os.getpid(),
            "base_loads": self.base_loads,
            "events": list(self.events),
            "join_s": dict(self.join_s),
            "together": list(self.batches.together),
            "busy_s": self.busy_s,
            "parked": sorted(name for name, t in self.tenants.items() if t.parked),
            "parks": self.residency.parks,
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

    @property
    def model(self) -> Any:
        """The PeftModel: the base with every tenant's adapters (None before the first)."""
        return self.shared.peft

    def _tenant(self, tenant: str) -> _Tenant:
        try:
            return self.tenants[tenant]
        except KeyError:
            raise KeyError(
                f"{tenant!r} is not a tenant of this shared worker (it left, or was dropped "
                f"after {self.stale_after_s:.0f} s without a call)"
            ) from None

    def _drop(self, tenant: str, why: str) -> bool:
        """Remove a tenant of either kind; True if it was here."""
        model = self.models.pop(tenant, None)
        t = self.tenants.pop(tenant, None)
        if t is None and model is None:
            return False
        if model is not None:
            model.model.close()
        if t is not None:
            if t.parked:
                os.unlink(t.parked)
            for adapter in t.adapters.values():
                self.model.delete_adapter(adapter)
        self.events.append((tenant, why, time.time()))
        self._idle_since = time.monotonic()
        return True

    def work(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` under the worker's lock, on its one work thread (the Ray
        actor takes calls on many threads; tensors allocated on one keep the process's memory
        in one allocator arena instead of one per thread); its time adds to ``busy_s``."""
        with self._lock:
            began = time.monotonic()
            try:
                return self._runner.submit(fn, *args, **kwargs).result()
            finally:
                self.busy_s += time.monotonic() - began

    def _empty(self) -> bool:
        """No tenant and no Tinker model: idle since ``_idle_since``."""
        return not self.tenants and not self.models

    def _watch(self) -> None:
        """Drop stale tenants; end the worker once it has been idle ``idle_timeout_s``."""
        if not ray.is_initialized():  # not a Ray actor (a benchmark's in-process worker)
            return
        handle = ray.get_runtime_context().current_actor
        while True:
            time.sleep(min(1.0, self.idle_timeout_s / 4))
            with self._lock:
                now = time.monotonic()
                every = [*self.tenants.items(), *self.models.items()]
                for name, t in every:
                    if now - t.last_call > self.stale_after_s:
                        self._drop(name, "dropped")
                idle = self._empty() and now - self._idle_since > self.idle_timeout_s
            if idle:
                handle.do.remote("exit_if_idle")
                return

    def exit_if_idle(self) -> None:
        """End the actor (its GPU slots given back) unless a tenant joined meanwhile."""
        with self._lock:
            if not self._empty():
                threading.Thread(target=self._watch, name="shared-idle", daemon=True).start()
                return
            self._slots.close()
        ray.actor.exit_actor()


def safe_name(name: str) -> str:
    """An adapter name PEFT accepts (no dots: they are module paths)."""
    return name.replace(".", "_").replace(":", "_")
