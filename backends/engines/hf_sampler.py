"""The torch/transformers sampler worker (``resources.sampler_backend: hf``): ``HFSampler``, a
plain class that ``backends.policy.workers`` runs as a long-lived Ray actor (or in-process for
benchmarks), with the Tinker-style verbs ``sample`` / ``sample_rows`` and weight sync
(``set_weights``). Rows of a batch share their prompts' cache and may each use their own
adapter, temperature and seed.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load as load_safetensors
from transformers import LogitsProcessor

from flowrl.agent_loop.types import SampleResult
from flowrl.backends.engines.algorithms import (
    token_logprobs,
)
from flowrl.backends.engines.hf_model import (
    Loaded,
    distinct_rows,
    load_policy_model,
    load_trainable_state,
    prefilled_cache,
    unsampled_token_ids,
    without_tokens,
    worker_device,
)
from flowrl.backends.models.chat import HFChatFormat
from flowrl.backends.models.lora_export import LORA_EXPORT
from flowrl.backends.models.model_folder import (
    pad_id,
)
from flowrl.backends.models.model_uri import resolve_model_uri
from flowrl.backends.models.precision import compute_dtype
from flowrl.backends.models.vlm import ImageInputs, vision_inputs
from flowrl.backends.types import WorkerSpec

if TYPE_CHECKING:
    pass


class HFSampler:
    """Batched sampling with HF ``generate``, returning token ids and float32 log-probs;
    weights and activations in ``spec.dtype`` (``backends.models.precision``)."""

    restartable = True
    """Built again in its process from a new spec, it is a new sampler (``actors``)."""

    def __init__(self, spec: WorkerSpec, loaded: Loaded | None = None, adapter: str = "default"):
        """``loaded``: a model loaded already (a shared worker's base, ``adapter`` being this
        sampler's LoRA adapter on it, active whenever a verb runs); None loads the spec's."""
        self.spec = spec
        self.adapter = adapter
        self.device = worker_device(spec)
        self.dtype = compute_dtype(spec.dtype, self.device)
        self.model, self.tokenizer, self.model_path = loaded or load_policy_model(spec, self.dtype)
        self.model.eval()
        self.image_inputs = ImageInputs.for_model(self.model_path)  # None: text only
        self.stop_token_ids = HFChatFormat.from_folder(self.model_path).stop_token_ids
        self.weights_version = 0
        self.follows: Any = None  # the trainer whose own model this samples (``following``)

    @classmethod
    def following(cls, spec: WorkerSpec, trainer: Any) -> HFSampler | None:
        """A sampler of ``trainer``'s weights, in ``trainer``'s process (a colocated policy's
        hybrid engine), with no model loaded of its own. Where ``trainer`` is a
        ``TorchTrainer`` of ``spec``'s model, adapter and device: in the trainer's float32 its
        own model (one copy of the weights, a sync that copies nothing: it samples whatever
        the trainer's weights are now, and says their version); in bfloat16 a bf16 cast of it
        (a LoRA adapter stays float32, as PEFT keeps it), whose sync (``catch_up``) casts the
        trained weights across in place. Sampling the float32 masters under autocast instead
        was slower and took more memory (docs/benchmarks/field.md). Else None."""
        from flowrl.backends.engines.torch_trainer import TorchTrainer

        if type(trainer) is not TorchTrainer or not _same_weights(spec, trainer.spec):
            return None  # e.g. DeepSpeed's: its engine holds the weights its own way
        model, device = trainer.model, worker_device(spec)
        dtype = compute_dtype(spec.dtype, device)
        if device != trainer.device:
            return None
        training = model.training
        if dtype != _dtype(model):  # each weight cast as it is copied (a trained adapter kept)
            kept = spec.lora.enabled
            memo: dict[int, Any] = {
                id(p): torch.nn.Parameter(
                    p.detach().clone() if kept and p.requires_grad else p.detach().to(dtype),
                    requires_grad=False,
                )
                for p in model.parameters()
            }
            model = copy.deepcopy(model, memo)
        sampler = cls(spec, (model, trainer.tokenizer, trainer.model_path), trainer.adapter)
        trainer.model.train(training)  # its mode; sampling switches to eval while it runs
        sampler.follows = trainer
        return sampler

    @torch.no_grad()
    def sample(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        seed: int | None = None,
        images: list[list[bytes]] | None = None,
    ) -> list[SampleResult]:
        """Sample one completion per prompt (temperature 0 = greedy). Prompts: B lists of ids;
        ``images[i]``: the encoded images whose tokens prompt ``i`` holds, in order."""
        if not prompts:
            return []
        vision = vision_inputs(self.image_inputs, images, self.device)
        unsampled = unsampled_token_ids(self.image_inputs)
        if seed is not None:
            torch.manual_seed(seed)
        pad = pad_id(self.tokenizer)
        ids, attention = _left_padded(prompts, pad, self.device)
        width = ids.shape[1]
        greedy = temperature <= 0
        with _evaluating(self.model):
            shared = {} if vision else _shared_prompt_cache(self.model, ids, attention)
            out = self.model.generate(
                input_ids=ids,
                attention_mask=attention,
                **vision,
                **shared,
                suppress_tokens=unsampled or None,
                max_new_tokens=max_new_tokens,
                do_sample=not greedy,
                temperature=None if greedy else temperature,
                top_k=None,
                top_p=None,
                eos_token_id=self.stop_token_ids,
                pad_token_id=pad,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new_B_T = out.sequences[:, width:].cpu()
        logits_B_T_V = without_tokens(torch.stack(out.logits, dim=1).float().cpu(), unsampled)
        scale = 1.0 if greedy else temperature
        logprobs_B_T = token_logprobs(logits_B_T_V / scale, new_B_T)
        return [self._cut(new_B_T[i], logprobs_B_T[i]) for i in range(len(prompts))]

    @torch.no_grad()
    def sample_rows(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperatures: list[float],
        seeds: list[int],
        adapters: list[str],
    ) -> list[SampleResult]:
        """Sample one completion per prompt where each row has its own temperature, seed and
        LoRA adapter (``_RowAdapters``): rows of several tenants of a shared worker in one
        forward pass. A row's randomness is its own (Gumbel-max noise from a generator
        seeded by its seed), so which other rows share the batch changes none of its draws;
        text only, LoRA on linear layers."""
        if not prompts:
            return []
        pad = pad_id(self.tokenizer)
        ids, attention = _left_padded(prompts, pad, self.device)
        width = ids.shape[1]
        with _evaluating(self.model), _RowAdapters(self.model) as route:
            shared = _shared_prompt_cache(self.model, ids, attention, adapters, route)
            route.route(adapters)
            out = self.model.generate(
                input_ids=ids,
                attention_mask=attention,
                **shared,
                max_new_tokens=max_new_tokens,
                do_sample=False,  # the rows' own noise makes the argmax a sample
                logits_processor=[_RowNoise(temperatures, seeds)],
                eos_token_id=self.stop_token_ids,
                pad_token_id=pad,
                output_logits=True,
                return_dict_in_generate=True,
            )
        new_B_T = out.sequences[:, width:].cpu()
        logits_B_T_V = torch.stack(out.logits, dim=1).float().cpu()
        scale_B = torch.tensor([t if t > 0 else 1.0 for t in temperatures])
        logprobs_B_T = token_logprobs(logits_B_T_V / scale_B[:, None, None], new_B_T)
        return [self._cut(new_B_T[i], logprobs_B_T[i]) for i in range(len(prompts))]

    def _cut(self, tokens_T: torch.Tensor, logprobs_T: torch.Tensor) -> SampleResult:
        tokens = tokens_T.tolist()
        for t, tok in enumerate(tokens):
            if tok in self.stop_token_ids:
                return SampleResult(tokens[: t + 1], logprobs_T[: t + 1].tolist(), "stop")
        return SampleResult(tokens, logprobs_T.tolist(), "length")

    def set_weights(self, weights: tuple[dict[str, torch.Tensor], int]) -> int:
        """Weight sync: load ``TorchTrainer.get_weights()`` (adapter only for LoRA)."""
        state, version = weights
        if self._shares_model():  # weights of its own from now on, as a separate sampler's
            self.model = copy.deepcopy(self.model).eval()
        self.follows = None
        state = {k: v.to(self.device) for k, v in state.items()}
        load_trainable_state(self.model, state, self.spec.lora.enabled, self.adapter)
        self.weights_version = version
        return version

    def get_weights_version(self) -> int:
        if self._shares_model():
            return self.follows.get_weights_version()
        return self.weights_version

    def catch_up(self) -> int:
        """A weight sync of a sampler ``following`` its trainer: nothing to copy where it
        samples the trainer's own model; else the trained weights cast into its own, in place
        (no state dict in between). The synced version."""
        if self._shares_model():
            return self.get_weights_version()
        own = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, p in self.follows.model.named_parameters():
                if p.requires_grad:
                    own[name].copy_(p)
        self.weights_version = self.follows.get_weights_version()
        return self.weights_version

    def _shares_model(self) -> bool:
        return self.follows is not None and self.follows.model is self.model

    def load_lora_export(self, model_uri: str) -> int:
        """The adapter of the exported LoRA policy at ``model_uri`` (its ``LORA_EXPORT``) as
        this sampler's weights (version 0): a LoRA version sampled on its base."""
        folder = Path(resolve_model_uri(model_uri, self.spec.cache_dir)) / LORA_EXPORT
        state = load_safetensors((folder / "adapter.safetensors").read_bytes())
        return self.set_weights((state, 0))


def _same_weights(a: WorkerSpec, b: WorkerSpec) -> bool:
    """Whether workers of ``a`` and ``b`` load the same weights (model, adapter, its seed)."""
    keys = ("model_uri", "cache_dir", "lora", "seed", "device")
    return all(getattr(a, k) == getattr(b, k) for k in keys)


def _dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


@contextlib.contextmanager
def _evaluating(model: torch.nn.Module) -> Iterator[None]:
    """``model`` in eval mode (no dropout) while sampling; its mode as it was after."""
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


def _left_padded(
    prompts: list[list[int]], pad: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask) of ``prompts`` left-padded to the longest, on ``device``."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    attention = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        attention[i, width - len(p) :] = 1
    return ids.to(device), attention.to(device)


class _RowNoise(LogitsProcessor):
    """A logits processor sampling each row with its own temperature and generator: it adds
    Gumbel noise to the row's scores over its temperature (Gumbel-max: the argmax is then a
    draw from the softmax), drawn from a generator seeded with the row's seed, a few steps'
    noise at a time; temperature 0 leaves the row greedy."""

    NOISE_FLOATS = 1 << 22  # at most this many noise values drawn ahead

    def __init__(self, temperatures: list[float], seeds: list[int]):
        self.sampled = [i for i, t in enumerate(temperatures) if t > 0]
        self.scale_S = torch.tensor([temperatures[i] for i in self.sampled])
        self.generators = [torch.Generator().manual_seed(seeds[i]) for i in self.sampled]
        self.noise_S_K_V: torch.Tensor | None = None
        self.step = 0

    def __call__(self, input_ids: torch.Tensor, scores_B_V: torch.Tensor) -> torch.Tensor:
        if not self.sampled:
            return scores_B_V
        if self.noise_S_K_V is None or self.step == self.noise_S_K_V.shape[1]:
            vocab = scores_B_V.shape[1]
            k = max(1, min(16, self.NOISE_FLOATS // (len(self.sampled) * vocab)))
            u = [torch.rand(k, vocab, generator=g) for g in self.generators]
            self.noise_S_K_V = -torch.log(-torch.log(torch.stack(u).clamp_(1e-20, 1.0)))
            self.step = 0
        gumbel_S_V = self.noise_S_K_V[:, self.step].to(scores_B_V.device)
        self.step += 1
        out = scores_B_V.float().clone()
        rows = torch.tensor(self.sampled, device=out.device)
        out[rows] = out[rows] / self.scale_S.to(out.device)[:, None] + gumbel_S_V
        return out


class _RowAdapters:
    """While entered, each LoRA linear layer of ``model`` adds to each run of consecutive rows
    the adapter ``route`` names for them (set before each forward pass): a batched LoRA path for
    rows of several adapters that slices contiguous runs instead of gathering rows per layer
    (PEFT's ``adapter_names`` path does that, at a cost per layer that dominates small models).
    Only LoRA on linear layers, without DoRA."""

    def __init__(self, model: torch.nn.Module):
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer

        self.layers = [m for m in model.modules() if isinstance(m, LoraLinear)]
        others = [m for m in model.modules() if isinstance(m, LoraLayer) and m not in self.layers]
        if others or any(any(m.use_dora.values()) for m in self.layers):
            raise NotImplementedError("rows of several adapters: LoRA on linear layers only")
        self.runs: list[tuple[str, int, int]] = []

    def route(self, names: list[str]) -> None:
        """The next forward passes' rows: row i with the adapter ``names[i]``."""
        self.runs = []
        for i, name in enumerate(names):
            if self.runs and self.runs[-1][0] == name:
                self.runs[-1] = (name, self.runs[-1][1], i + 1)
            else:
                self.runs.append((name, i, i + 1))

    def __enter__(self) -> _RowAdapters:
        for layer in self.layers:
            layer.forward = functools.partial(self._forward, layer)
        return self

    def __exit__(self, *exc: object) -> None:
        for layer in self.layers:
            del layer.forward  # the class's own again

    def _forward(self, layer: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        result = layer.base_layer(x, *args, **kwargs)
        for name, lo, hi in self.runs:
            if name in layer.lora_A:
                a, b = layer.lora_A[name], layer.lora_B[name]
                rows = layer.lora_dropout[name](x[lo:hi].to(a.weight.dtype))
                result[lo:hi] += (b(a(rows)) * layer.scaling[name]).to(result.dtype)
        return result


def _shared_prompt_cache(
    model: torch.nn.Module,
    ids_B_T: torch.Tensor,
    attention_B_T: torch.Tensor,
    adapters: list[str] | None = None,
    route: _RowAdapters | None = None,
) -> dict[str, Any]:
    """``generate``'s ``past_key_values`` when rows repeat a prompt (a GRPO group's samples
    share theirs): every distinct prompt but its last token is prefilled once, and the KV
    cache is copied to the rows that repeat it, so ``generate`` only runs the last prompt token
    and the new ones. Empty (prefill as usual) when every prompt is distinct. ``adapters``: each
    row's LoRA adapter, routed by ``route``: rows share a prefill only with their adapter's."""
    keys = [tuple(row) for row in ids_B_T.tolist()]
    if adapters is not None:
        keys = [(adapter, *key) for adapter, key in zip(adapters, keys, strict=True)]
    first, index = distinct_rows(keys)
    if len(first) == len(index) or ids_B_T.shape[1] < 2:
        return {}
    if adapters is not None and route is not None:
        route.route([adapters[i] for i in first])
    cache = prefilled_cache(model, ids_B_T[first, :-1], attention_B_T[first, :-1], index)
    return {"past_key_values": cache}
