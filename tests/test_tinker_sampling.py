"""A Tinker sample's prompt (``backends/engines/tinker/model.py``): run once for all of a
request's samples, its KV cache copied to each, and every sample's log-probs still the
trainer's log-probs of the tokens it drew, in each family's architecture."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from families import FAMILIES, build_family

from flowrl.backends.engines.tinker.model import TinkerModel
from flowrl.backends.engines.tinker.types import Datum, SampleParams, tinker_lora


@pytest.mark.parametrize("family", ["qwen3", "llama3", "mistral"])
def test_a_prompts_samples_share_one_prefill_and_keep_the_trainers_logprobs(
    family: str, tmp_path: Path
) -> None:
    model = TinkerModel(build_family(FAMILIES[family], tmp_path), tinker_lora(rank=4), seed=3)
    prompt = model.tokenizer.encode("What is 12+7? Think, then answer.")
    batches: list[tuple[int, int]] = []
    hook = model.model.register_forward_hook(
        lambda _m, _a, kw, _o: batches.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    params = SampleParams(max_tokens=8, temperature=1.0, seed=11)
    out = model.sample(prompt, 6, params, "live")
    hook.remove()
    assert batches[0] == (1, len(prompt))  # the prompt, once
    assert batches[1:] and all(shape == (6, 1) for shape in batches[1:])  # one token a row
    drawn = [s.tokens for s in out.sequences]
    assert len(drawn) == 6 and len({tuple(t) for t in drawn}) > 1  # rows of their own
    assert model.sample(prompt, 6, params, "live").sequences == out.sequences  # seeded
    data = [Datum(prompt + t[:-1], {"target_tokens": np.array(prompt[1:] + t)}) for t in drawn]
    scored = model.forward_backward(data, "cross_entropy", forward_only=True).outputs
    for sequence, trainer in zip(out.sequences, scored, strict=True):
        own = trainer["logprobs"][len(prompt) - 1 :]
        np.testing.assert_allclose(sequence.logprobs, own, atol=1e-4)
