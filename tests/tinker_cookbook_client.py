"""A thin Tinker client that uses ``tinker-cookbook`` unchanged (run by
tests/test_tinker_cookbook.py with ``.venv-client/bin/python``, never flowrl's venv: the cookbook
pins an older transformers, and flowrl is not installed there).

Reads one JSON job on stdin::

    {"folder": ..., "renderer": "qwen3", "base_model": ..., "conversations": [[message, ...], ...],
     "steps": 15, "learning_rate": 1e-2, "rank": 8, "seed": 0}

and finds the server the SDK's own way: ``TINKER_BASE_URL`` and ``TINKER_API_KEY``. The
conversations go through the cookbook's renderer and ``conversation_to_datum``; the datums then
train a LoRA adapter with ``forward_backward(…, "cross_entropy")`` + ``optim_step``. Prints one
JSON line on stdout: per datum what the renderer weighted, and per step the mean NLL (from the
returned ``logprobs`` and the datums' weights) next to the server's ``loss:sum``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import tinker
from tinker import types
from tinker_cookbook import renderers
from tinker_cookbook.supervised.data import conversation_to_datum
from transformers import AutoTokenizer


def describe(datum: types.Datum, tokenizer: Any, conversation: list[dict]) -> dict[str, Any]:
    """What the renderer made of one conversation: the weighted / unweighted target text, and
    whether its tokens are the fixture's own chat template's (HF ``apply_chat_template``)."""
    inputs = datum.model_input.to_ints()
    targets = datum.loss_fn_inputs["target_tokens"].tolist()
    weights = datum.loss_fn_inputs["weights"].tolist()
    rendered = inputs + targets[-1:]
    template = tokenizer.apply_chat_template(conversation, tokenize=False)
    # The renderer stops at the last <|im_end|>; the template adds the newline after it.
    expected = tokenizer.encode(template.removesuffix("\n"), add_special_tokens=False)
    return {
        "tokens": len(rendered),
        "shifted": inputs[1:] == targets[:-1],
        "weight_sum": sum(weights),
        "weighted_tokens": sum(1 for w in weights if w > 0),
        "weighted": tokenizer.decode([t for t, w in zip(targets, weights, strict=True) if w > 0]),
        "unweighted": tokenizer.decode(
            [t for t, w in zip(targets, weights, strict=True) if w == 0]
        ),
        "matches_template": rendered == expected,
    }


def mean_nll(result: Any, data: list[types.Datum]) -> float:
    """Σ -logprob·weight / Σ weight over every datum, from the server's per-token logprobs."""
    total, weight = 0.0, 0.0
    for output, datum in zip(result.loss_fn_outputs, data, strict=True):
        logprobs = output["logprobs"].tolist()
        weights = datum.loss_fn_inputs["weights"].tolist()
        assert len(logprobs) == len(weights), (len(logprobs), len(weights))
        total += sum(-lp * w for lp, w in zip(logprobs, weights, strict=True))
        weight += sum(weights)
    return total / weight


def main() -> None:
    job = json.load(sys.stdin)
    tokenizer = AutoTokenizer.from_pretrained(job["folder"])
    renderer = renderers.get_renderer(job["renderer"], tokenizer)
    conversations = job["conversations"]
    data = [conversation_to_datum(c, renderer, max_length=None) for c in conversations]
    report: dict[str, Any] = {
        "datums": [describe(d, tokenizer, c) for d, c in zip(data, conversations, strict=True)]
    }

    service = tinker.ServiceClient()  # TINKER_BASE_URL / TINKER_API_KEY
    report["models"] = [m.model_name for m in service.get_server_capabilities().supported_models]
    training = service.create_lora_training_client(
        job["base_model"], rank=job.get("rank", 8), seed=job.get("seed", 0)
    )
    report["model_id"] = training.get_info().model_id
    steps = []
    for _ in range(job["steps"]):
        forward = training.forward_backward(data, "cross_entropy")
        optim = training.optim_step(types.AdamParams(learning_rate=job["learning_rate"]))
        result = forward.result()
        optim.result()
        steps.append({"nll": mean_nll(result, data), "loss_sum": result.metrics["loss:sum"]})
    report["steps"] = steps
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
