"""A shared worker's sampling calls answered together (``SharedWorker.call_as``): the calls
of several tenants that arrive while the worker is busy go through one forward pass, each
tenant's rows through its own adapter, each row with its own temperature and random stream
(``HFSampler.sample_rows``). A call that finds no company samples alone, the same way; if a
batch together fails, each of its calls runs again alone, so a bad call fails only its tenant.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from flowrl.agent_loop.types import SampleResult
from flowrl.backends.models.precision import forward_autocast

if TYPE_CHECKING:
    from flowrl.backends.engines.shared_worker import SharedWorker


@dataclass
class SamplingCall:
    """One tenant's sampling call waiting to run, alone or with others'."""

    tenant: str
    prompts: list[list[int]]
    max_new_tokens: int
    temperature: float
    seed: int | None
    result: list[SampleResult] | None = None
    error: BaseException | None = None
    done: bool = False


class Batches:
    """The calls waiting on ``worker`` and how many each batch run together answered."""

    def __init__(self, worker: SharedWorker):
        self.worker = worker
        self.waiting: list[SamplingCall] = []  # calls not yet run (under ``queue``)
        self.queue = threading.Lock()
        self.together: list[int] = []  # the number of calls each batch run together answered

    def sample(self, call: SamplingCall) -> list[SampleResult]:
        """Queue ``call``; whoever holds the worker next runs every queued call at once."""
        with self.queue:
            self.waiting.append(call)

        def run_waiting() -> None:
            if not call.done:  # else answered together with an earlier call
                with self.queue:
                    batch, self.waiting = self.waiting, []
                self._run_together(batch)

        self.worker.work(run_waiting)
        if call.error is not None:
            raise call.error
        assert call.result is not None
        return call.result

    def _run_together(self, batch: list[SamplingCall]) -> None:
        w = self.worker
        mixable = [c for c in batch if c.seed is not None and c.tenant in w.tenants]
        if w.residency.resident:  # tenants of one batch are in memory together
            fits = {c.tenant for c in mixable[: w.residency.resident]}
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
                args = (call.prompts, call.max_new_tokens, call.temperature, call.seed)
                try:
                    call.result = w.call_alone(call.tenant, "sampler", "sample", *args)
                except Exception as exc:  # noqa: BLE001 - raised in the caller's thread
                    call.error = exc
                call.done = True

    def _sample_rows(self, calls: list[SamplingCall]) -> list[list[SampleResult]]:
        """The calls' rows in one batch, each with its tenant's sampler adapter and a seed of
        its own (its call's seed and its place in the call); each call's results."""
        w = self.worker
        for call in calls:
            w.residency.unpark(w.tenants[call.tenant], keep={c.tenant for c in calls})
        prompts, temperatures, seeds, adapters = [], [], [], []
        for call in calls:
            adapter = w.tenants[call.tenant].adapters["sampler"]
            for i, prompt in enumerate(call.prompts):
                prompts.append(prompt)
                temperatures.append(call.temperature)
                seeds.append((call.seed * 1_000_003 + i) % 2**63)
                adapters.append(adapter)
        leader = w.tenants[calls[0].tenant].workers["sampler"]
        w.model.train(False)
        torch.set_num_threads(leader.spec.torch_threads)
        longest = max(call.max_new_tokens for call in calls)
        with forward_autocast(leader.dtype, w.device):
            rows = leader.sample_rows(prompts, longest, temperatures, seeds, adapters)
        out, start = [], 0
        now = time.monotonic()
        for call in calls:
            mine = rows[start : start + len(call.prompts)]
            start += len(call.prompts)
            out.append([_cut(r, call.max_new_tokens) for r in mine])
            t = w.tenants[call.tenant]
            t.last_call, t.calls = now, t.calls + 1
        return out


def _cut(result: SampleResult, max_new_tokens: int) -> SampleResult:
    """``result`` as a call with ``max_new_tokens`` would have it (its batch sampled longer)."""
    if len(result.tokens) <= max_new_tokens:
        return result
    return SampleResult(result.tokens[:max_new_tokens], result.logprobs[:max_new_tokens], "length")
