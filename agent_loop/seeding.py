"""Deterministic seeds from content (``stable_hash``, ``derived_seed``) and a sampler that seeds
call k with (base, k), so a retried step re-samples the same tokens, wherever its episodes are
played (the job's process or the sampler's own: ``backends.engines.episodes``)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from flowrl.agent_loop.types import SampleResult


def stable_hash(*parts: Any, length: int = 12) -> str:
    """A short content hash of JSON-serialisable parts (cache keys, seeds)."""
    blob = json.dumps(parts, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:length]


def derived_seed(*parts: Any) -> int:
    return int(stable_hash(*parts, length=8), 16)


class SeededSampler:
    """Adapts a sampler worker (anything with the backends' ``sample(prompts, max_new_tokens,
    temperature, seed, images=...)``: a worker's proxy, or the backend itself) to the agent
    loop's ``Sampler``; call k uses seed (base, k).

    A rollout is thereby a pure function of (weights, step): a retried step re-samples the
    same tokens.
    """

    def __init__(self, worker: Any, base_seed: int):
        self._worker = worker
        self._base_seed = base_seed
        self._calls = 0

    def sample(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        images: list[list[bytes]] | None = None,
    ) -> list[SampleResult]:
        seed = derived_seed(self._base_seed, self._calls)
        self._calls += 1
        if images is None:  # text only: the call every sampler backend understands
            return self._worker.sample(prompts, max_new_tokens, temperature, seed)
        return self._worker.sample(prompts, max_new_tokens, temperature, seed, images=images)
