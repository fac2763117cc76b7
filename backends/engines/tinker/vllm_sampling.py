"""The Tinker API's sampling on vLLM (``flowrl serve tinker --sampler-engine vllm``): a
sampling model of the service (a base model and an adapter shape) is one vLLM engine, in a Ray
actor on vLLM's venv (``backends.policy.placement.VLLMEngines``), and each saved sampler weights
(``save_weights_for_sampler``, a path or a snapshot) is a LoRA adapter it loads by key. The
training models stay where ``--placement`` puts them; only sampling moves.

Semantics as ``TinkerModel.sample`` (``backends.engines.tinker.model``), with these differences:
- log-probs are vLLM's processed ones: of the distribution sampled from after temperature
  *and* top-k / top-p (the HF engine's are before top-k / top-p; equal when neither is set);
- a seed seeds the engine's generator for the call (vLLM's CPU engine refuses per-request
  seeds): the same call with the same seed samples the same tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from flowrl.backends.engines.tinker.types import (
    SampledSequence,
    SampleOutput,
    SampleParams,
    TinkerInputError,
    check_fits,
)
from flowrl.backends.engines.vllm_sampler import VLLMSampler
from flowrl.backends.types import WorkerSpec


class TinkerVLLMSampler:
    """One vLLM engine of a base model, sampling saved adapters by key (or the base alone)."""

    restartable = False

    def __init__(self, spec: WorkerSpec):
        self.engine = VLLMSampler(spec)
        self.eos_ids = list(self.engine.stop_token_ids)
        self.info = {
            "vocab_size": self.engine.vocab_size,
            "context_length": self.engine.max_model_len,
        }
        self._adapters: dict[str, Any] = {}
        self._loaded = 0  # adapters loaded so far: each gets a new id

    def describe(self) -> dict[str, int]:
        """What the service checks a request against (``check_fits``)."""
        return dict(self.info)

    def add_snapshot_bytes(self, key: str, data: bytes) -> None:
        """A saved adapter (``adapter.safetensors``' bytes) to sample as ``key``."""
        state = load_safetensors(data)
        previous = self._adapters.pop(key, None)  # the same key saved again: its new weights
        if previous is not None:
            self.engine.drop_adapter(previous)
        self._loaded += 1
        self._adapters[key] = self.engine.adapter_request(
            f"sampler-{self._loaded}", self._loaded, state
        )

    def sample(
        self,
        prompt: list[int],
        num_samples: int,
        params: SampleParams,
        weights: str | None,
        prompt_logprobs: bool = False,
        images: Sequence[Any] = (),
    ) -> SampleOutput:
        """``num_samples`` completions of ``prompt`` with the adapter saved as ``weights``
        (None: the base model alone). Image prompts are the hf sampler's (a 400 here)."""
        from vllm import SamplingParams

        if images:
            raise TinkerInputError("image prompts are served by the hf sampler, not by vllm")
        if not prompt:
            raise TinkerInputError("prompt is empty")
        check_fits(prompt, params, self.info)
        if weights is not None and weights not in self._adapters:
            raise TinkerInputError(f"unknown sampler weights {weights!r}")
        greedy = params.temperature <= 0
        sampling = SamplingParams(
            n=num_samples,
            temperature=0.0 if greedy else params.temperature,
            top_k=0 if params.top_k in (-1, 0) else params.top_k,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            logprobs=0,
            prompt_logprobs=0 if prompt_logprobs else None,
            stop_token_ids=sorted(set(params.stop_tokens) | set(self.eos_ids)),
            stop=list(params.stop_strings) or None,
            include_stop_str_in_output=True,
            skip_special_tokens=False,
        )
        if params.seed is not None:
            torch.manual_seed(params.seed)
        (out,) = self.engine.llm.generate(
            [{"prompt_token_ids": list(prompt)}],
            sampling_params=sampling,
            lora_request=None if weights is None else self._adapters[weights],
            use_tqdm=False,
        )
        sequences = [_sequence(c) for c in out.outputs]
        prompt_lp = None
        if prompt_logprobs:
            rows = out.prompt_logprobs or []
            prompt_lp = [math.nan] + [
                float(row[tok].logprob) for tok, row in zip(prompt[1:], rows[1:], strict=True)
            ]
        return SampleOutput(sequences, prompt_lp)

    def close(self) -> None:
        self._adapters.clear()


def _sequence(completion: Any) -> SampledSequence:
    tokens = [int(t) for t in completion.token_ids]
    logprobs = [float(step[t].logprob) for t, step in zip(tokens, completion.logprobs, strict=True)]
    return SampledSequence(
        tokens, logprobs, "stop" if completion.finish_reason == "stop" else "length"
    )
