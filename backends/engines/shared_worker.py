"""A shared base-model worker: one process holds a base model once, frozen, and the LoRA
adapters of many jobs (its tenants), each with its own optimiser, step count and RNG.

``backends.policy.actors.SharedPolicy`` is a tenant's placement: the tenant's sampler and trainer
are an ``HFSampler`` and a ``TorchTrainer`` built on the worker's model, each with an adapter of its
own (the sampler's holds the weights of the last sync, so sampling one step off policy sees
the weights it should). Every verb runs with its tenant's adapter active and its tenant's RNG
state in torch's global generator, so what a tenant computes does not depend on the others:
its sampled tokens and log-probs on fixed prompts are bit-identical whether or not another
tenant trains in between (fp32, CPU). A weight sync is a copy inside the process.

Sampling calls of several tenants that arrive while the worker is busy are answered together:
their rows go through one forward pass, each tenant's rows through its adapter in every LoRA
layer, each row with its own temperature and random stream (``HFSampler.sample_rows``), so a
tenant's draws do not depend on whose rows share the batch. A call that arrives alone runs as a
job's own sampler would, bit for bit. If a batch together fails, each call in it runs alone, so
a bad call fails only its tenant.

The worker's base and adapters are a ``engines.tinker.model.SharedBase``: Tinker API training models
(``ModelTenancy``; ``backends.policy.placement.SharedTenant``) are adapters on the same base, next
to the jobs', with the verbs and state of the Tinker API's own models.

With ``resident`` set, at most that many tenants keep their tensors in memory: a call of a
parked tenant first parks the least recently used resident one — its adapters, gradients and
optimiser state written to the worker's disk (safetensors), its tensors emptied — and restores
its own, exactly: its next step is bit-identical to one never parked (rl-train tenants; Tinker
models stay in memory).

The worker is a detached, named Ray actor (``shared-<hash of base, precision, device>``):
it outlives the job that started it, the next job on the same base joins it without a
restart, and once it has had no tenant for ``idle_timeout_s`` it ends, giving back the GPU
slots it holds (once, for all its tenants). A tenant whose job was killed without leaving is
dropped after ``stale_after_s`` without a call.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import ray
import torch

from flowrl.agent_loop.types import SampleResult
from flowrl.backends.engines import parking
from flowrl.backends.engines.hf_model import lora_config, worker_device
from flowrl.backends.engines.hf_sampler import HFSampler
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


@dataclass
class _Sampling:
    """One tenant's sampling call waiting to run, alone or with others' (``call_as``)."""

    tenant: str
    prompts: list[list[int]]
    max_new_tokens: int
    temperature: float
    seed: int | None
    result: list[SampleResult] | None = None
    error: BaseException | None = None
    done: bool = False


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
        self._waiting: list[_Sampling] = []  # sampling calls not yet run (under _queue)
        self._queue = threading.Lock()
        self.together: list[int] = []  # the number of calls each batch run together answered
        self.busy_s = 0.0  # seconds the worker has spent running calls
        self.resident = resident
        self.parks = 0  # tenants parked on disk so far (each restored on its next call)
        self._park_dir: str | None = None  # made when the first tenant is parked
        threading.Thread(target=self._watch, name="shared-idle", daemon=True).start()

    # ------------------------------------------------------------------------ tenants

    def join(self, tenant: str, tenancy: Tenancy) -> dict[str, Any]:
        """Add ``tenant``: a job's sampler and trainer (``JobTenancy``) or a Tinker API
        training model (``ModelTenancy``), LoRA on this worker's base; a tenant of that name
        joins again afresh. The seconds it took (``join_s``), and for a model its vocabulary
        size and context length."""
        began = time.monotonic()
        if isinstance(tenancy, ModelTenancy):
            info = self._work(self._join_model, tenant, tenancy, began)
        else:
            info = {"join_s": self._work(self._join, tenant, tenancy.specs, began)}
        return info

    def _join(self, tenant: str, specs: dict[str, WorkerSpec], began: float) -> float:
        for spec in specs.values():
            self._check(spec)
        self._drop(tenant, "left")
        self._make_room(None)
        adapters = {role: f"{_safe(tenant)}-{role}" for role in specs}
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
        return self._work(self._drop, tenant, "left")

    def call_as(self, tenant: str, role: str, verb: str, *args: Any, **kwargs: Any) -> Any:
        """``verb`` of ``tenant``'s ``role`` (a job's ``sampler`` or ``trainer``; a Tinker
        model's ``model``), with its adapter active and its RNG; text sampling calls may run
        together with other tenants' (the module's docstring)."""
        model = self.models.get(tenant)
        if model is not None or role == "model":
            return self._call_model(tenant, model, role, verb, *args, **kwargs)
        if self.mix_batches and role == "sampler" and verb == "sample" and not kwargs:
            if len(args) in (3, 4):  # prompts, max_new_tokens, temperature[, seed]
                return self._sample(_Sampling(tenant, *args))
        return self._work(self._call, tenant, role, verb, *args, **kwargs)

    def _call(self, tenant: str, role: str, verb: str, *args: Any, **kwargs: Any) -> Any:
        """``call_as`` under the worker's lock: one tenant's verb, alone."""
        t = self._tenant(tenant)
        self._unpark(t)
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

    def _sample(self, call: _Sampling) -> list[SampleResult]:
        """Queue ``call``; whoever holds the worker next runs every queued call at once."""
        with self._queue:
            self._waiting.append(call)

        def run_waiting() -> None:
            if not call.done:  # else answered together with an earlier call
                with self._queue:
                    batch, self._waiting = self._waiting, []
                self._run_together(batch)

        self._work(run_waiting)
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result

    def _run_together(self, batch: list[_Sampling]) -> None:
        mixable = [c for c in batch if c.seed is not None and c.tenant in self.tenants]
        if self.resident:  # tenants of one batch are in memory together
            fits = {c.tenant for c in mixable[: self.resident]}
            mixable = [c for c in mixable if c.tenant in fits]
        # A call that finds no company samples the same way (its rows' own seeds): its draws
        # never depend on whether other tenants' calls happened to arrive with it.
        if mixable:
            try:
                results = self._sample_rows(mixable)
            except Exception:  # noqa: BLE001 - each call again alone: a bad one fails alone
                pass
            else:
                for call, result in zip(mixable, results, strict=True):
                    call.result, call.done = result, True
                if len(mixable) > 1:
                    self.together.append(len(mixable))
        for call in batch:
            if not call.done:
                try:
                    call.result = self._call(
                        call.tenant,
                        "sampler",
                        "sample",
                        call.prompts,
                        call.max_new_tokens,
                        call.temperature,
                        call.seed,
                    )
                except Exception as exc:  # noqa: BLE001 - raised in the caller's thread
                    call.error = exc
                call.done = True

    def _sample_rows(self, calls: list[_Sampling]) -> list[list[SampleResult]]:
        """The calls' rows in one batch, each with its tenant's sampler adapter and a seed of
        its own (its call's seed and its place in the call); each call's results."""
        for call in calls:
            self._unpark(self.tenants[call.tenant], keep={c.tenant for c in calls})
        prompts, temperatures, seeds, adapters = [], [], [], []
        for call in calls:
            adapter = self.tenants[call.tenant].adapters["sampler"]
            for i, prompt in enumerate(call.prompts):
                prompts.append(prompt)
                temperatures.append(call.temperature)
                seeds.append((call.seed * 1_000_003 + i) % 2**63)
                adapters.append(adapter)
        leader = self.tenants[calls[0].tenant].workers["sampler"]
        self.model.train(False)
        torch.set_num_threads(leader.spec.torch_threads)
        longest = max(call.max_new_tokens for call in calls)
        with forward_autocast(leader.dtype, self.device):
            rows = leader.sample_rows(prompts, longest, temperatures, seeds, adapters)
        out, start = [], 0
        now = time.monotonic()
        for call in calls:
            mine = rows[start : start + len(call.prompts)]
            start += len(call.prompts)
            out.append([_cut(r, call.max_new_tokens) for r in mine])
            t = self.tenants[call.tenant]
            t.last_call, t.calls = now, t.calls + 1
        return out

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
        return self._work(self._model_verb, t.model, verb, *args, **kwargs)

    def _model_verb(self, model: TinkerModel, verb: str, *args: Any, **kwargs: Any) -> Any:
        self.model.eval()  # Tinker's verbs: no dropout
        torch.set_num_threads(self.spec.torch_threads)
        return getattr(model, verb)(*args, **kwargs)

    def sync(self, tenant: str) -> int:
        """``tenant``'s trainer weights into its sampler (a copy in this process)."""
        return self._work(self._sync, tenant)

    def _sync(self, tenant: str) -> int:
        return self._call(
            tenant, "sampler", "set_weights", self._call(tenant, "trainer", "get_weights")
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
            "together": list(self.together),
            "busy_s": self.busy_s,
            "parked": sorted(name for name, t in self.tenants.items() if t.parked),
            "parks": self.parks,
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

    def _unpark(self, t: _Tenant, keep: set[str] = frozenset()) -> None:
        """``t``'s tensors back in memory, exactly as parked, once others are parked to make
        room (``_make_room``)."""
        t.last_call = time.monotonic()
        if not t.parked:
            return
        self._make_room(t, keep)
        parking.unpark(self._tensors(t), self._optimizer(t), t.parked, self.device)
        t.parked = None

    def _make_room(self, t: _Tenant | None, keep: set[str] = frozenset()) -> None:
        """Park the least recently used tenants in memory (not ``t``, nor those in ``keep``)
        until ``t`` fits among ``resident`` tenants in memory."""
        if not self.resident:
            return
        others = [u for u in self.tenants.values() if u is not t and not u.parked]
        movable = sorted((u for u in others if u.name not in keep), key=lambda u: u.last_call)
        for u in movable[: max(0, len(others) + 1 - self.resident)]:
            self._park(u)

    def _park(self, t: _Tenant) -> None:
        """``t``'s adapters, gradients and optimiser state to a file (``backends.engines.parking``);
        its tensors emptied."""
        if self._park_dir is None:  # in the worker's model cache: room for the adapters
            os.makedirs(self.spec.cache_dir, exist_ok=True)
            self._park_dir = tempfile.mkdtemp(prefix="parked-", dir=self.spec.cache_dir)
        t.parked = os.path.join(self._park_dir, f"{_safe(next(iter(t.adapters.values())))}.st")
        parking.park(self._tensors(t), self._optimizer(t), t.parked)
        self.parks += 1

    def _tensors(self, t: _Tenant) -> dict[str, torch.nn.Parameter]:
        """``t``'s adapter parameters by name (its two adapters: sampler's and trainer's)."""
        marks = tuple(f".{adapter}." for adapter in t.adapters.values())
        return {n: p for n, p in self.model.named_parameters() if any(m in n for m in marks)}

    @staticmethod
    def _optimizer(t: _Tenant) -> torch.optim.Optimizer:
        return t.workers["trainer"].optimizer

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

    def _work(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
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


def _safe(name: str) -> str:
    """An adapter name PEFT accepts (no dots: they are module paths)."""
    return name.replace(".", "_").replace(":", "_")


def _cut(result: SampleResult, max_new_tokens: int) -> SampleResult:
    """``result`` as a call with ``max_new_tokens`` would have it (its batch sampled longer)."""
    if len(result.tokens) <= max_new_tokens:
        return result
    return SampleResult(result.tokens[:max_new_tokens], result.logprobs[:max_new_tokens], "length")
