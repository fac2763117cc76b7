"""The Tinker verbs on one model: a frozen base model with a trainable LoRA adapter and its own
AdamW, as the Tinker API means them (``forward_backward``, ``optim_step``, ``sample``,
``save_state`` / ``load_state``).

The math follows the Tinker SDK's documented semantics:

- A datum is a token list (``model_input``) and per-token ``loss_fn_inputs``; position ``t``'s
  target is ``target_tokens[t]`` (the caller shifts), so ``logprobs[t] =
  log_softmax(logits[t])[target_tokens[t]]``.
- Losses are **sums** over every token of every datum (no mean), and gradients **accumulate**
  over ``forward_backward`` calls until ``optim_step`` applies and clears them:

  - ``cross_entropy``: ``-weights * logprobs`` (``weights`` default 1);
  - ``importance_sampling``: ``-exp(logprobs - sampler_logprobs) * advantages``;
  - ``ppo``: ``-min(r * A, clip(r, low, high) * A)``, ``r = exp(logprobs - sampler_logprobs)``;
  - ``cispo``: ``-stopgrad(clip(r, low, high)) * A * logprobs``;
  - ``dro``: ``-(logprobs * A - beta / 2 * (logprobs - sampler_logprobs) ** 2)`` (``beta``:
    ``loss_fn_config``'s, default 0.05);
  - ``gspo`` (GSPO-token): each token's ratio ``s_t`` has the value of its sequence's ratio
    ``s = exp(mean over M of (logprobs - sampler_logprobs))`` and the gradient of its own
    log-prob, then ``-min(s_t * A, clip(s_t, low, high) * A)``; ``M`` is the datum's
    ``sequence_ratio_mask`` (nonzero entries), by default its tokens with a nonzero advantage;

  ``low`` / ``high`` are ``loss_fn_config``'s ``clip_low_threshold`` / ``clip_high_threshold``
  (default 0.8 / 1.2), or per-token ``loss_fn_inputs`` of the same names.
- Each datum gets back its ``logprobs`` and ``elementwise_loss``; metrics are ``loss:sum``.

Sampling uses a named adapter snapshot (``snapshot``: the weights at a
``save_weights_for_sampler``), the live adapter, or the base model alone. Its log-probs are
those of the distribution sampled from (the logits divided by the temperature, before top-k /
top-p; temperature 0 = greedy, unscaled).
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import secrets
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from flowrl.backends.engines import parking
from flowrl.backends.engines.tinker.custom_loss import CustomLoss
from flowrl.backends.engines.tinker.forward import run_pass
from flowrl.backends.engines.tinker.losses import rows_without_gradient
from flowrl.backends.engines.tinker.scoring import score_prompt
from flowrl.backends.engines.tinker.types import (
    IMAGE_SLOT,
    Datum,
    ForwardOutput,
    ImageInput,
    PromptScoring,
    SampledSequence,
    SampleOutput,
    SampleParams,
    TinkerInputError,
    check_batch,
    check_tokens,
)
from flowrl.backends.engines.tinker.vision import Vision, vision_kwargs
from flowrl.backends.models.model_folder import load_causal_lm, load_tokenizer
from flowrl.backends.types import LoraSettings


class SharedBase:
    """A base model loaded once, frozen, and the LoRA adapters of its tenants (``TinkerModel``s,
    PEFT adapters by name): one tenant's adapter is active at a time, under ``lock``. With
    ``resident``, at most that many adapters are resident: a tenant that needs its adapter when the
    slots are full parks the least recently used one (adapter, AdamW state and step count as
    ``state_bytes`` writes them, and its gradients, to disk; its RNG) and takes its place; the
    parked tenant is restored exactly on its next call."""

    def __init__(
        self,
        base_path: str,
        device: str | torch.device = "cpu",
        resident: int | None = None,
        loaded: tuple[torch.nn.Module, Any] | None = None,
    ):
        """``loaded``: the base model (float32, on ``device``) and its tokenizer, loaded already
        (a shared base-model worker's, ``backends.engines.shared_worker``); None loads them."""
        self.base_path = base_path
        self.device = torch.device(device)
        self.resident_limit = resident
        if loaded is None:
            loaded = (load_causal_lm(base_path, torch.float32).to(self.device), None)
        self.base = loaded[0]
        self.modules = {n.rsplit(".", 1)[-1] for n, _ in self.base.named_modules()}
        self.vocab_size = int(self.base.get_output_embeddings().weight.shape[0])
        self.context_length = int(getattr(self.base.config, "max_position_embeddings", 0) or 0)
        self.tokenizer = loaded[1] or load_tokenizer(base_path)
        self.eos_ids = _eos_ids(self.base, self.tokenizer)
        self.vision = Vision.of(base_path, self.base)
        self.peft: Any = None
        self.lock = threading.RLock()
        self.resident: OrderedDict[str, TinkerModel] = OrderedDict()  # least recently used first
        self.evictions = 0
        self.park_dir = tempfile.mkdtemp(prefix="parked-")  # parked tenants' files

    def add_adapter(self, name: str, lora: LoraSettings, seed: int) -> None:
        """A Tinker model's adapter, on those of its ``target_modules`` the base has."""
        config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=[m for m in lora.target_modules if m in self.modules],
            task_type="CAUSAL_LM",
        )
        self.add_lora(name, config, seed)

    def add_lora(self, name: str, config: LoraConfig, seed: int) -> None:
        """The adapter ``name`` of ``config`` on the base, initialised from ``seed`` alone (the
        first one wraps the base in PEFT)."""
        with torch.random.fork_rng(devices=[]):  # the init depends on the seed alone
            torch.manual_seed(seed)
            if self.peft is None:
                self.peft = get_peft_model(self.base, config, adapter_name=name).to(self.device)
                self.peft.eval()  # no dropout anywhere; gradients still reach the adapter
            else:
                self.peft.add_adapter(name, config)
                self.peft.to(self.device)

    @contextlib.contextmanager
    def use(self, tenant: TinkerModel) -> Iterator[Any]:
        """The model with ``tenant``'s adapter resident and active, for one call."""
        with self.lock:
            if tenant.name not in self.resident:
                limit = self.resident_limit
                while limit is not None and len(self.resident) >= limit:
                    _, lru = self.resident.popitem(last=False)
                    lru.park()
                    self.evictions += 1
                tenant.unpark()
                self.resident[tenant.name] = tenant
            self.resident.move_to_end(tenant.name)
            self.peft.set_adapter(tenant.name)
            yield self.peft

    def leave(self, tenant: TinkerModel) -> None:
        with self.lock:
            if self.resident.pop(tenant.name, None) is not None:
                self.peft.delete_adapter(tenant.name)


class TinkerModel:
    """One tenant of a base model: a trainable LoRA adapter with its own AdamW, step count and
    sampling RNG, and snapshots of the adapter for sampling; state saved to and loaded from
    bytes. ``base`` is a model folder (a base of its own) or a ``SharedBase`` that other
    tenants use too (each with its own ``name``). ``seed`` seeds the adapter's initial weights
    and the sampling RNG (None: a random one; a Tinker ``LoraConfig``'s ``seed``)."""

    def __init__(
        self,
        base: str | SharedBase,
        lora: LoraSettings,
        seed: int | None = None,
        device: str = "cpu",
        name: str = "default",
    ):
        self.base = base if isinstance(base, SharedBase) else SharedBase(base, device)
        self.lora = lora
        self.name = name.replace(":", "_").replace(".", "_")
        self.device = self.base.device
        self.base_path = self.base.base_path
        self.vocab_size = self.base.vocab_size
        self.context_length = self.base.context_length
        self.tokenizer = self.base.tokenizer
        self.eos_ids = self.base.eos_ids
        self.seed = seed if seed is not None else secrets.randbits(62)
        self.steps = 0
        self.snapshots: dict[str, dict[str, torch.Tensor]] = {}
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(self.seed)
        self.parked: str | None = None  # the file its tensors are parked in
        self.params: list[torch.nn.Parameter] = []
        self.optimizer: Any = None
        with self.base.use(self):
            pass

    @property
    def model(self) -> Any:
        return self.base.peft

    def unpark(self) -> None:
        """Make the adapter resident: new (its seeded init), or exactly as it was parked."""
        self.base.add_adapter(self.name, self.lora, self.seed)
        self.base.peft.set_adapter(self.name)
        self.params = [p for p in self.base.peft.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12)
        if self.parked is not None:
            parked, self.parked = self.parked, None
            parking.unpark(self._named_params(), self.optimizer, parked, self.device)

    def park(self) -> None:
        """Write the adapter, its accumulated gradients and AdamW's state to the base's disk
        (``backends.engines.parking``, the format a shared worker's tenants park in) and free the
        adapter's place; ``unpark`` restores them bit for bit. The step count and the RNG stay
        in memory."""
        with self.base.lock:
            self.base.peft.set_adapter(self.name)
            handle, path = tempfile.mkstemp(prefix="model-", suffix=".st", dir=self.base.park_dir)
            os.close(handle)
            parking.park(self._named_params(), self.optimizer, path)
            self.parked = path
            self.base.peft.delete_adapter(self.name)
            self.params, self.optimizer = [], None

    def _named_params(self) -> dict[str, torch.nn.Parameter]:
        """The adapter's parameters by name."""
        mark = f".{self.name}."
        return {n: p for n, p in self.base.peft.named_parameters() if mark in n}

    def close(self) -> None:
        """Leave the base (the adapter's slot is freed; snapshots dropped)."""
        self.base.leave(self)
        self.snapshots.clear()
        if self.parked is not None and os.path.exists(self.parked):
            os.unlink(self.parked)
        self.parked = None

    # ----------------------------------------------------------------------- training

    def forward_backward(
        self,
        data: Sequence[Datum],
        loss_fn: str,
        config: dict[str, float] | None = None,
        forward_only: bool = False,
        custom: CustomLoss | None = None,
    ) -> ForwardOutput:
        """Per-datum log-probs and element-wise losses; with ``forward_only`` False the loss's
        gradients are added to the adapter's (until ``optim_step``). ``loss_fn`` ``custom``
        runs ``custom`` (a client's uploaded loss) on each datum: no element-wise loss, its
        metrics beside ``loss:sum``. Data whose loss is 0 whatever the weights
        (``rows_without_gradient``: an advantage or weight of 0 on every token) are run
        forward only, with no graph kept for a backward pass: the gradients are the same."""
        needs = None if custom is None else custom.inputs[1:]
        config = config or {}
        check_batch(data, loss_fn, config, self.vocab_size, custom_inputs=needs)
        idle = set() if forward_only or custom is not None else rows_without_gradient(data, loss_fn)
        live = [i for i in range(len(data)) if i not in idle]
        outputs: list[dict[str, np.ndarray]] = [{} for _ in data]
        total, metrics = 0.0, {}
        with self.base.use(self):
            for rows, backward in ((live, not forward_only), (sorted(idle), False)):
                if rows:
                    part = [data[i] for i in rows]
                    loss, done, metrics = run_pass(self, part, loss_fn, config, custom, backward)
                    total += loss
                    for i, out in zip(rows, done, strict=True):
                        outputs[i] = out
            if idle and not live:  # as a backward pass of a loss of 0 leaves them
                for param in self.params:
                    if param.grad is None:
                        param.grad = torch.zeros_like(param)
        return ForwardOutput(outputs, {"loss:sum": total, **metrics})

    def optim_step(
        self,
        learning_rate: float,
        beta1: float = 0.9,
        beta2: float = 0.95,
        eps: float = 1e-12,
        weight_decay: float = 0.0,
        grad_clip_norm: float = 0.0,
    ) -> dict[str, float]:
        """One AdamW step with the parameters as sent, on the gradients accumulated since the
        last step; then the gradients are cleared."""
        with self.base.use(self):
            return self._optim_step(learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm)

    def _optim_step(
        self,
        learning_rate: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        grad_clip_norm: float,
    ) -> dict[str, float]:
        for group in self.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        grads = [p.grad for p in self.params if p.grad is not None]
        norm = (
            float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))
            if grads
            else 0.0
        )
        if grad_clip_norm > 0 and grads:
            torch.nn.utils.clip_grad_norm_(self.params, grad_clip_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        return {"grad_norm:mean": norm, "learning_rate:mean": learning_rate}

    # ----------------------------------------------------------------------- sampling

    def snapshot(self, key: str) -> None:
        """Keep the adapter's weights as they are now under ``key`` (a sampler's weights)."""
        with self.base.use(self):
            self.snapshots[key] = self.adapter_state()

    def add_snapshot_bytes(self, key: str, data: bytes) -> None:
        """Keep a saved adapter (``adapter.safetensors``' bytes) under ``key`` for sampling."""
        state = adapter_from_bytes(data)
        with self.base.use(self):
            keys = set(self.adapter_state())
        if set(state) != keys:
            raise TinkerInputError("the saved adapter does not fit this model")
        self.snapshots[key] = {k: v.to(self.device) for k, v in state.items()}

    @torch.no_grad()
    def sample(
        self,
        prompt: list[int],
        num_samples: int,
        params: SampleParams,
        weights: str | None,
        prompt_logprobs: bool | PromptScoring = False,
        images: Sequence[ImageInput] = (),
    ) -> SampleOutput:
        """``num_samples`` completions of ``prompt`` with the snapshot ``weights`` ("live": the
        adapter now; None: the base model alone), and what ``prompt_logprobs`` asks of the
        prompt (True: each token's log-prob)."""
        scoring = prompt_logprobs
        if not isinstance(scoring, PromptScoring):
            scoring = PromptScoring(logprobs=bool(scoring))
        if scoring.targets is not None:
            wanted = scoring.targets[scoring.targets != -1]
            check_tokens(wanted.tolist(), self.vocab_size, "target_prompt_logprobs")
        check_tokens([t for t in prompt if t != IMAGE_SLOT], self.vocab_size, "prompt")
        if not prompt:
            raise TinkerInputError("prompt is empty")
        if self.context_length and len(prompt) + params.max_tokens > self.context_length:
            raise TinkerInputError(
                f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"model's context length {self.context_length}"
            )
        generator = self.generator
        if params.seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(params.seed)
        with self.base.use(self), self._weights(weights):
            return _generate(self, prompt, images, num_samples, params, generator, scoring)

    @contextlib.contextmanager
    def _weights(self, key: str | None) -> Iterator[None]:
        if key is None:
            with self.model.disable_adapter():
                yield
            return
        if key == "live":
            yield
            return
        if key not in self.snapshots:
            raise TinkerInputError(f"unknown sampler weights {key!r}")
        live = self.adapter_state()
        set_peft_model_state_dict(self.model, self.snapshots[key], adapter_name=self.name)
        try:
            yield
        finally:
            set_peft_model_state_dict(self.model, live, adapter_name=self.name)

    # ----------------------------------------------------------------------- state

    def adapter_state(self) -> dict[str, torch.Tensor]:
        """The adapter's weights (detached copies; keys without the adapter's name)."""
        state = get_peft_model_state_dict(
            self.model, adapter_name=self.name, save_embedding_layers=False
        )
        return {k: v.detach().clone() for k, v in state.items()}

    def state_bytes(self, optimizer: bool) -> dict[str, bytes]:
        """The adapter (safetensors) and, with ``optimizer``, AdamW's state (torch, tensors
        only): what ``save_state`` writes."""
        with self.base.use(self):
            return self._files(optimizer)

    def _files(self, optimizer: bool) -> dict[str, bytes]:
        cpu = {k: v.cpu().contiguous() for k, v in self.adapter_state().items()}
        files = {"adapter.safetensors": save_safetensors(cpu)}
        if optimizer:
            buffer = io.BytesIO()
            torch.save({"optimizer": self.optimizer.state_dict(), "steps": self.steps}, buffer)
            files["optimizer.pt"] = buffer.getvalue()
        return files

    def load_state_bytes(self, files: dict[str, bytes], optimizer: bool) -> None:
        """Load ``state_bytes``' files: the adapter, and AdamW's state when ``optimizer`` (else
        the optimizer starts afresh)."""
        with self.base.use(self):
            self._load(files, optimizer)

    def _load(self, files: dict[str, bytes], optimizer: bool) -> None:
        state = adapter_from_bytes(files["adapter.safetensors"])
        state = {k: v.to(self.device) for k, v in state.items()}
        result = set_peft_model_state_dict(self.model, state, adapter_name=self.name)
        if getattr(result, "unexpected_keys", None):
            raise TinkerInputError("the checkpoint's adapter does not fit this model")
        self.optimizer.zero_grad(set_to_none=True)
        if optimizer:
            saved = torch.load(io.BytesIO(files["optimizer.pt"]), weights_only=True)
            self.optimizer.load_state_dict(saved["optimizer"])
            self.steps = int(saved["steps"])
        else:
            self.optimizer = torch.optim.AdamW(self.params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12)
            self.steps = 0


def _generate(
    tinker: TinkerModel,
    prompt: list[int],
    images: Sequence[ImageInput],
    n: int,
    params: SampleParams,
    generator: torch.Generator,
    scoring: PromptScoring,
) -> SampleOutput:
    """``n`` samples of ``prompt`` from ``tinker``'s model under its current weights, each
    stopping at a stop token or string, end of sequence, or ``params.max_tokens``. A text
    prompt is run once and its KV cache copied to the ``n`` rows; one with images runs in
    every row (its multimodal positions are the model's own, per row)."""
    rows = _prefill_rows(n, images)
    ids = torch.tensor([prompt] * rows, dtype=torch.long, device=tinker.device)
    extra = vision_kwargs(tinker.base.vision, ids, [list(images)] * rows)
    out = tinker.model(input_ids=ids, use_cache=True, **extra)
    past = out.past_key_values
    scored = score_prompt(out.logits[0, :-1].float(), ids[0].tolist(), scoring)
    logits = out.logits[:, -1, :].float().expand(n, -1)
    if rows < n:
        past.batch_repeat_interleave(n)
    stops = set(params.stop_tokens) | set(tinker.eos_ids)  # end of sequence always stops
    tokens: list[list[int]] = [[] for _ in range(n)]
    logps: list[list[float]] = [[] for _ in range(n)]
    reasons = ["length"] * n
    done = [False] * n
    for _ in range(params.max_tokens):
        nxt, lp = _pick(logits, params, generator)
        for i in range(n):
            if done[i]:
                continue
            tokens[i].append(int(nxt[i]))
            logps[i].append(float(lp[i]))
            if int(nxt[i]) in stops or _hit_stop_string(
                tinker.tokenizer, tokens[i], params.stop_strings
            ):
                done[i], reasons[i] = True, "stop"
        if all(done):
            break
        out = tinker.model(input_ids=nxt.view(n, 1), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1, :].float()
    sequences = [SampledSequence(tokens[i], logps[i], reasons[i]) for i in range(n)]
    return SampleOutput(sequences, *scored)


def _prefill_rows(n: int, images: Sequence[ImageInput]) -> int:
    """The rows a request of ``n`` samples runs its prompt in."""
    return n if images else 1


def _hit_stop_string(tokenizer: Any, tokens: list[int], stop_strings: tuple[str, ...]) -> bool:
    if not stop_strings:
        return False
    tail = tokenizer.decode(tokens[-16:], skip_special_tokens=False)
    return any(s in tail for s in stop_strings)


def adapter_from_bytes(data: bytes) -> dict[str, torch.Tensor]:
    return load_safetensors(data)


def _pick(
    logits: torch.Tensor, params: SampleParams, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """The next token of each row and its log-prob under the distribution sampled from."""
    if params.temperature <= 0:
        nxt = logits.argmax(dim=-1)
        return nxt, torch.log_softmax(logits, dim=-1).gather(1, nxt[:, None])[:, 0]
    scaled = logits / params.temperature
    logp = torch.log_softmax(scaled, dim=-1)
    filtered = scaled.clone()
    if params.top_k > 0 and params.top_k < filtered.shape[-1]:
        kth = torch.topk(filtered, params.top_k, dim=-1).values[:, -1:]
        filtered[filtered < kth] = -math.inf
    if params.top_p < 1.0:
        order = torch.sort(filtered, dim=-1, descending=True)
        probs = torch.softmax(order.values, dim=-1)
        outside = probs.cumsum(dim=-1) - probs > params.top_p  # keep the head reaching top_p
        drop = torch.zeros_like(outside).scatter(1, order.indices, outside)
        filtered[drop] = -math.inf
    nxt = torch.multinomial(torch.softmax(filtered, dim=-1), 1, generator=generator)[:, 0]
    return nxt, logp.gather(1, nxt[:, None])[:, 0]


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> tuple[int, ...]:
    ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if ids is None:
        ids = tokenizer.eos_token_id
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, (list, tuple)) else (int(ids),)
