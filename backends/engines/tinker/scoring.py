"""What a Tinker sample request asks of its prompt (``PromptScoring``), from the logits the
sampler's prefill computed: each token's log-prob, the top k at each position, and the
log-probs of chosen ids, all of the model's full softmax before sampling settings."""

from __future__ import annotations

import math

import numpy as np
import torch

from flowrl.backends.engines.tinker.types import MASK_LOGPROB, PromptScoring


def score_prompt(
    logits: torch.Tensor, prompt: list[int], scoring: PromptScoring
) -> tuple[list[float] | None, tuple[np.ndarray, np.ndarray] | None, np.ndarray | None]:
    """What ``scoring`` asks of the prompt, from its logits (row ``i`` predicts position
    ``i + 1``): its log-probs (NaN where not scored), the top k at each position, and the
    log-probs of the target ids."""
    if not scoring.wanted:
        return None, None, None
    logp = torch.log_softmax(logits, dim=-1)  # [P - 1, V]
    first = len(prompt) - scoring.last_n if scoring.last_n else 1  # the first position scored
    prompt_lp = None
    if scoring.logprobs:
        rows = logp.gather(1, torch.tensor(prompt[1:], device=logp.device)[:, None])[:, 0]
        prompt_lp = [math.nan] * first + rows[first - 1 :].tolist()
    topk = None
    if scoring.topk:
        k = min(scoring.topk, logp.shape[-1])
        ids = np.zeros((len(prompt), scoring.topk), np.int32)
        lps = np.full((len(prompt), scoring.topk), MASK_LOGPROB, np.float32)
        best = torch.topk(logp[first - 1 :], k, dim=-1)
        ids[first:, :k] = best.indices.cpu().numpy()
        lps[first:, :k] = best.values.cpu().numpy()
        topk = (ids, lps)
    targets = None
    if scoring.targets is not None:
        wanted = torch.from_numpy(np.where(scoring.targets < 0, 0, scoring.targets))
        picked = logp.gather(1, wanted.to(logp.device)).cpu().numpy()
        targets = np.where(scoring.targets < 0, 0.0, picked).astype(np.float32)
    return prompt_lp, topk, targets
