"""The torch trainer worker (``resources.trainer_backend: torch``): ``TorchTrainer``, a plain
class that ``backends.policy.workers`` runs as a long-lived Ray actor (or in-process), with the
Tinker-style verbs ``forward_backward``, ``optim_step``, ``save_state`` / ``load_state``,
``get_weights`` (weight sync) and ``export_pretrained``. Storage (fsspec, botocore) is imported
by the checkpoint verbs only, so the worker runs where those are not installed
(``benchmarks/gpu_check.py``).
"""

from __future__ import annotations

import functools
import inspect
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load_file as load_safetensors_file
from safetensors.torch import save_file as save_safetensors_file

from flowrl.backends.engines.algorithms import (
    KL_ESTIMATORS,
    LOSS_AGGREGATIONS,
    get_advantage_estimator,
    get_policy_loss,
    kl_penalized_rewards,
    mismatch_kl,
    off_policy_correction,
    token_logprobs,
)
from flowrl.backends.engines.hf_model import (
    Loaded,
    distinct_rows,
    load_policy_model,
    load_trainable_state,
    lora_config,
    prefilled_cache,
    trainable_state,
    unsampled_token_ids,
    without_tokens,
    worker_device,
    write_lora_export,
)
from flowrl.backends.engines.passes import (
    cpu_tokens_per_pass,
    merged_metrics,
    pass_share,
    split_passes,
)
from flowrl.backends.models.model_folder import (
    copy_model_files,
    load_causal_lm,
    pad_id,
)
from flowrl.backends.models.precision import compute_dtype, forward_autocast
from flowrl.backends.models.vlm import ImageInputs, vision_inputs
from flowrl.backends.types import Datum, WorkerSpec

if TYPE_CHECKING:
    pass


def _shared_prefix_logprobs(
    model: torch.nn.Module,
    data: list[Datum],
    b: dict[str, torch.Tensor],
    temperature: float,
    unsampled: list[int],
    dtype: torch.dtype,
) -> torch.Tensor | None:
    """``_next_token_logprobs`` at the positions the loss reads, with each distinct prompt run
    once: the tokens before a row's first loss token but one (its shared prefix) go through
    the model once per distinct prefix into a KV cache, copied to the rows that repeat it
    (gradients flow back through the copies); each row then runs only its last prompt token
    and the rest. A GRPO group's samples share their prompt, so at the default job the trainer
    computes about a sixth of the tokens. Positions before a row's loss tokens are 0.0. None
    (compute as usual) when no two rows share a prefix or a prompt is shorter than 2 tokens."""
    starts = [next((t for t, m in enumerate(d.loss_mask) if m), len(d.tokens)) for d in data]
    if min(starts) < 2:
        return None
    first, index = distinct_rows(
        [tuple(d.tokens[: p - 1]) for d, p in zip(data, starts, strict=True)]
    )
    if len(first) == len(index):
        return None
    ids, attention = b["ids"], b["attention"]
    device = ids.device
    shared = [starts[i] - 1 for i in first]  # prefix lengths, one per distinct prefix
    width = max(shared)
    prefix = torch.zeros((len(first), width), dtype=torch.long)
    prefix_mask = torch.zeros((len(first), width), dtype=torch.long)
    for u, (i, n) in enumerate(zip(first, shared, strict=True)):  # left padding
        prefix[u, width - n :] = torch.tensor(data[i].tokens[:n])
        prefix_mask[u, width - n :] = 1
    prefix, prefix_mask = prefix.to(device), prefix_mask.to(device)
    q_B = torch.tensor([p - 1 for p in starts], device=device)  # where each row's rest starts
    lengths_B = attention.sum(-1)
    rest = int((lengths_B - q_B).max())
    if rest < 2:  # no row has a token to score
        return None
    offsets = torch.arange(rest, device=device)
    columns_B_S = (q_B.unsqueeze(-1) + offsets).clamp(max=ids.shape[1] - 1)
    rest_mask = (offsets < (lengths_B - q_B).unsqueeze(-1)).long()
    rest_ids = ids.gather(1, columns_B_S).masked_fill(rest_mask == 0, 0)
    with forward_autocast(dtype, device):
        cache = prefilled_cache(model, prefix, prefix_mask, index)
        logits = model(
            input_ids=rest_ids,
            attention_mask=torch.cat([prefix_mask[index], rest_mask], dim=1),
            position_ids=(q_B.unsqueeze(-1) + offsets).masked_fill(rest_mask == 0, 0),
            past_key_values=cache,
        ).logits
    rest_B_S = token_logprobs(
        without_tokens(logits[:, :-1].float(), unsampled) / temperature, rest_ids[:, 1:]
    )
    # Back to the batch's layout: column t holds the log-prob of token t+1, i.e. rest column
    # t - q; outside [q, length - 1) nothing the loss reads.
    t_B_T = torch.arange(ids.shape[1] - 1, device=device).expand(len(data), -1)
    at = (t_B_T - q_B.unsqueeze(-1)).clamp(0, rest - 2)
    inside = (t_B_T >= q_B.unsqueeze(-1)) & (t_B_T < (lengths_B - 1).unsqueeze(-1))
    return rest_B_S.gather(1, at).masked_fill(~inside, 0.0)


def _next_token_logprobs(
    model: torch.nn.Module,
    b: dict[str, torch.Tensor],
    temperature: float,
    unsampled: list[int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """``(B, T-1)`` float32 log-probs of each next token of ``b["ids"]`` under the policy
    (images through ``pixel_values`` when the batch has them); the forward pass autocasts to
    ``dtype``, the log-softmax is float32. ``unsampled`` tokens are excluded from the
    distribution; where one is the target (an injected image token, mask 0) the log-prob is
    0.0 rather than -inf, so masked sums stay finite."""
    vision = {"pixel_values": b["pixel_values"]} if "pixel_values" in b else {}
    with forward_autocast(dtype, b["ids"].device):
        logits = model(input_ids=b["ids"], attention_mask=b["attention"], **vision).logits
    targets = b["ids"][:, 1:]
    logprobs = token_logprobs(
        without_tokens(logits[:, :-1].float(), unsampled) / temperature, targets
    )
    if not unsampled:
        return logprobs
    injected = torch.isin(targets, torch.tensor(unsampled, device=targets.device))
    return logprobs.masked_fill(injected, 0.0)


def _off_policy_correction(
    logprobs_B_T: torch.Tensor,
    b: dict[str, torch.Tensor],
    sampled_B_T: torch.Tensor,
    correction: dict[str, Any] | None,
) -> tuple[torch.Tensor, torch.Tensor | None, dict[str, float]]:
    """The policy loss's old log-probs and per-token weights, with their metrics.

    ``correction`` unset: the sampler's log-probs and no weights, so the ratio is
    ``pi_theta / pi_sampler`` and the sampler/trainer mismatch (and, with rollouts sampled
    ahead, the updates the sampler is behind) sits inside it. Set (``{"name": "tis" | "mis" |
    "decoupled", "cap": …, "band": …}``, ``algorithms.off_policy_correction``): the ratio is
    against the trainer's own log-probs before the update (the proximal policy), and each
    sampled token's term is weighted by its importance weight against the sampler (the
    behaviour policy): truncated (tis), dropped outside a band (mis) or dropped over a cap
    (decoupled); rows without sampler log-probs get weight 1.
    """
    if correction is None:
        return b["old"], None, {}
    weigh = off_policy_correction(
        correction["name"], correction.get("cap"), tuple(correction.get("band", (0.5, 2.0)))
    )
    # The RL update stage (tasks.rl.update) takes exactly one optimiser step per batch: one
    # forward_backward, then one optim_step. So the trainer's log-probs before the update are
    # this forward pass's, detached (the ratio starts at 1): no second pass is needed. With
    # schedule.off_policy_steps 1 the trainer is an update ahead of the sampler, and w then
    # corrects that update's change too (the sampler is the behaviour policy).
    trainer_old_B_T = logprobs_B_T.detach()
    weights_B_T, metrics = weigh(trainer_old_B_T, b["old"], sampled_B_T)
    return trainer_old_B_T, weights_B_T, metrics


@functools.cache
def _default_aggregation(loss_fn: str) -> str:
    """The ``loss_agg`` that the policy loss ``loss_fn`` takes when none is given."""
    return inspect.signature(get_policy_loss(loss_fn)).parameters["loss_agg"].default


def _rows_with_a_gradient(
    data: list[Datum], loss_agg: str
) -> tuple[list[Datum], float, dict[str, float]]:
    """The rows of a policy-loss batch whose advantage is not 0, the factor that makes their
    loss the whole batch's, and ``zero_advantage_rows`` (the share left out).

    Every policy loss (``algorithms.POLICY_LOSSES``) is a sum of per-token terms each times its
    row's advantage: a row of advantage 0 (a GRPO group whose samples all scored the same)
    adds 0 to the loss and to every gradient. So those rows skip the forward and backward
    passes, and the others' loss is scaled by the aggregation's denominators
    (``algorithms.aggregation_denominator``): the loss and its gradient are the whole batch's.
    The ratio metrics (``clip_fraction``, ``approx_kl``, ``mismatch_kl``, …) are then over the
    rows that ran."""
    kept = [i for i, d in enumerate(data) if d.advantage != 0.0]
    if len(kept) == len(data):
        return data, 1.0, {"zero_advantage_rows": 0.0}
    rows = [data[i] for i in kept]
    share = pass_share(loss_agg, rows, data) if kept else 0.0
    left_out = {"zero_advantage_rows": 1.0 - len(kept) / len(data)}
    return rows, share, left_out


def _padded_batch(data: list[Datum], pad: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Right-pad a list of Datum into B x T tensors (shifted so position t predicts t+1)."""
    width = max(len(d.tokens) for d in data)

    def padded(rows: list[list], value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([r + [value] * (width - len(r)) for r in rows], dtype=dtype)

    ids = padded([d.tokens for d in data], pad, torch.long)
    attention = padded([[1] * len(d.tokens) for d in data], 0, torch.long)
    mask = padded([d.loss_mask for d in data], 0.0, torch.float32)
    old = padded([d.old_logprobs or [0.0] * len(d.tokens) for d in data], 0.0, torch.float32)
    batch = {
        "ids": ids,
        "attention": attention,
        "mask": mask[:, 1:],
        "old": old[:, 1:],
        "has_old": torch.tensor([float(bool(d.old_logprobs)) for d in data]),
        "advantages": torch.tensor([d.advantage for d in data], dtype=torch.float32),
    }
    return {k: v.to(device) for k, v in batch.items()}


def _zero_loss(model: torch.nn.Module, device: torch.device) -> torch.Tensor:
    """0 as a function of every trainable weight: its backward gives them zero gradients, as a
    batch of advantage-0 rows run through the model would."""
    trainable = (p.sum() * 0.0 for p in model.parameters() if p.requires_grad)
    return sum(trainable, torch.zeros((), device=device))


FUSED_ADAMW_MIN_PARAMETERS = 10_000_000
CHECKPOINT_FILES = ("weights.safetensors", "optimizer.pt", "rng.pt")
"""A checkpoint's files (``TorchTrainer.save_state``)."""


def _fused_adamw(params: list[torch.nn.Parameter], device: torch.device) -> bool | None:
    """True (torch's fused AdamW: one kernel per parameter, none of the default for-each's
    whole-model temporaries) for ``FUSED_ADAMW_MIN_PARAMETERS`` trainable weights or more on
    CPU or CUDA; else None (torch's default). At 99M parameters on 2 cores fused took a whole
    job's step from 3.92 to 3.69 s (docs/benchmarks/field.md's ~100M job); at 3.19M it saves
    ~4 ms of a 1.3 s step, and at 0.34M it changed a warm-up's trajectory enough to miss its
    target (tests/test_agent_training.py's SFT: 0.03 after 600 steps where the default's
    reached 0.45 at 470): small models keep the default's numbers."""
    big = sum(p.numel() for p in params) >= FUSED_ADAMW_MIN_PARAMETERS
    return True if big and device.type in ("cpu", "cuda") else None


class TorchTrainer:
    """AdamW on all weights or on a LoRA adapter; losses chosen by name. Master weights and
    optimiser state are float32; with ``spec.dtype`` bfloat16 the forward pass autocasts
    (``backends.models.precision``)."""

    restartable = True
    """Built again in its process from a new spec, it is a new trainer (``actors``)."""
    backward_without_rows = True
    """A batch whose every row has advantage 0 gives zero gradients without a forward pass
    (``_zero_loss``); else its rows run as without the skip."""
    passes_on_cpu = True
    """On a CPU a large update runs in passes (``passes.cpu_tokens_per_pass``)."""

    def __init__(self, spec: WorkerSpec, loaded: Loaded | None = None, adapter: str = "default"):
        """``loaded`` and ``adapter``: as ``HFSampler``'s (the optimiser holds the parameters
        that require gradients when it is built: the active adapter's)."""
        self.spec = spec
        self.adapter = adapter
        self.device = worker_device(spec)
        self.dtype = compute_dtype(spec.dtype, self.device)
        self.model, self.tokenizer, self.model_path = loaded or load_policy_model(spec)
        self.model.train()
        self.image_inputs = ImageInputs.for_model(self.model_path)  # None: text only
        self.optimizer = self._new_optimizer()
        self.version = 0
        self._reference: torch.nn.Module | None = None  # full-parameter KL only

    def _new_optimizer(self) -> torch.optim.Optimizer:
        """AdamW; fused on CPU and CUDA from ``FUSED_ADAMW_MIN_PARAMETERS`` trainable weights
        up (``_fused_adamw``)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        fused = _fused_adamw(params, self.device)
        spec = self.spec
        return torch.optim.AdamW(
            params, spec.learning_rate, weight_decay=spec.weight_decay, fused=fused
        )

    def _batch(self, data: list[Datum]) -> dict[str, torch.Tensor]:
        """``_padded_batch`` on this worker's device, plus ``pixel_values`` of the data's images
        when any datum has some."""
        batch = _padded_batch(data, pad_id(self.tokenizer), self.device)
        return batch | vision_inputs(self.image_inputs, [d.images for d in data], self.device)

    def _logprobs(self, b: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
        """Log-probs of each next token; ``temperature`` matches the sampling distribution."""
        return _next_token_logprobs(
            self.model, b, temperature, unsampled_token_ids(self.image_inputs), self.dtype
        )

    def _loss_logprobs(
        self, data: list[Datum], b: dict[str, torch.Tensor], temperature: float
    ) -> torch.Tensor:
        """``_logprobs`` where the loss reads them (``b["mask"]``); rows that repeat a prompt
        (a GRPO group) run it once (``_shared_prefix_logprobs``)."""
        if "pixel_values" not in b:
            shared = _shared_prefix_logprobs(
                self.model,
                data,
                b,
                temperature,
                unsampled_token_ids(self.image_inputs),
                self.dtype,
            )
            if shared is not None:
                return shared
        return self._logprobs(b, temperature)

    def forward_backward(
        self,
        data: list[Datum],
        loss_fn: str,
        loss_config: dict[str, Any] | None = None,
        temperature: float = 1.0,
    ) -> dict[str, float]:
        """Accumulate gradients of ``loss_fn`` over ``data``.

        ``"cross_entropy"`` is SFT (mean NLL over mask-1 tokens); any other name is a policy
        loss from ``backends.engines.algorithms.POLICY_LOSSES``, evaluated at the sampling
        ``temperature`` so that the ratio to the sampler's log-probs starts at 1.
        ``loss_config`` holds the loss's options (``clip_eps``, ``clip_eps_high``, ``loss_agg``)
        and optionally ``kl_coef`` / ``kl_estimator``: with ``kl_coef > 0`` the loss gains
        ``kl_coef * agg(kl(logp, ref_logp))`` against the reference model. With ``is_correction``
        (or ``tis_cap``) set the policy loss is corrected for the sampler/trainer mismatch
        (``_off_policy_correction``).
        Where data carry the sampler's log-probs, the metrics include ``mismatch_kl``
        (``algorithms.mismatch_kl``): sampler/trainer precision drift on an on-policy step; one
        step off policy it includes one update's change as well.
        """
        options = dict(loss_config or {})
        kl_coef = float(options.pop("kl_coef", 0.0))
        kl_estimator = options.pop("kl_estimator", "k3")
        correction = options.pop("is_correction", None)
        tis_cap = options.pop("tis_cap", None)  # the older spelling of {"name": "tis", "cap": C}
        if correction is None and tis_cap is not None:
            correction = {"name": "tis", "cap": tis_cap}
        skip = options.pop("skip_zero_advantage", True) and loss_fn != "cross_entropy"
        share, skipped = 1.0, {}
        agg = "token-mean" if loss_fn == "cross_entropy" else None
        agg = agg or options.get("loss_agg") or _default_aggregation(loss_fn)
        if skip and kl_coef == 0:  # a KL term is not 0 at advantage 0
            kept, share, skipped = _rows_with_a_gradient(data, agg)
            if not kept and self.backward_without_rows:
                # zero gradients, not none: AdamW still steps (momentum, weight decay)
                self._backward(_zero_loss(self.model, self.device))
                return {"loss": 0.0, **skipped}
            if kept:
                data = kept
            else:  # every row, as without the skip
                share, skipped = 1.0, {"zero_advantage_rows": 0.0}
        on_cpu = self.passes_on_cpu and self.device.type == "cpu"
        tokens = cpu_tokens_per_pass(self.model) if on_cpu else None
        kl = (kl_coef, kl_estimator, options.get("loss_agg", "token-mean"))
        total, parts = 0.0, []
        for rows in split_passes(data, tokens):  # gradients accumulate: the whole batch's
            part = pass_share(agg, rows, data)
            scales = (share * part, pass_share(kl[2], rows, data))
            loss, metrics = _one_pass(
                self, rows, loss_fn, options, temperature, correction, kl, scales
            )
            total += loss
            parts.append((part, metrics))
        return {"loss": total, **merged_metrics(parts), **skipped}

    def _backward(self, loss: torch.Tensor) -> None:
        """Backpropagate ``loss`` (the DeepSpeed trainer routes it through its engine)."""
        loss.backward()

    @torch.no_grad()
    def _reference_logprobs(
        self, b: dict[str, torch.Tensor], temperature: float = 1.0
    ) -> torch.Tensor:
        """Log-probs under the reference policy: with LoRA the base model with the adapter
        disabled (no second copy); full-parameter, a frozen copy of the starting weights,
        loaded on first use (only jobs with a KL term pay for it)."""
        if self.spec.lora.enabled:
            with self.model.disable_adapter():
                return self._logprobs(b, temperature)
        if self._reference is None:
            reference = load_causal_lm(self.model_path).to(self.device).eval()
            self._reference = reference.requires_grad_(False)
        return _next_token_logprobs(
            self._reference, b, temperature, unsampled_token_ids(self.image_inputs), self.dtype
        )

    @torch.no_grad()
    def compute_ref_logprobs(
        self, data: list[Datum], temperature: float = 1.0
    ) -> list[list[float]]:
        """Reference log-probability of every token given its prefix (first token: 0.0), for
        a KL penalty in the reward."""
        b = self._batch(data)
        ref_B_T = self._reference_logprobs(b, temperature)
        return [[0.0] + ref_B_T[i, : len(d.tokens) - 1].tolist() for i, d in enumerate(data)]

    def advantages(self, rewards: list[float], group_ids: list[int], estimator: str) -> list[float]:
        """Each episode's advantage from the returns of its group (``estimator``: an
        ``algorithms.ADVANTAGE_ESTIMATORS`` name). The reward stage asks the trainer, which
        holds the algorithms, so the flow's process never imports torch."""
        rewards_N = torch.tensor(rewards, dtype=torch.float32)
        groups_N = torch.tensor(group_ids)
        return get_advantage_estimator(estimator)(rewards_N, groups_N).tolist()

    @torch.no_grad()
    def kl_penalised_advantages(
        self,
        data: list[Datum],
        rewards: list[float],
        group_ids: list[int],
        temperature: float,
        kl_coef: float,
        kl_estimator: str,
        estimator: str,
    ) -> tuple[list[float], dict[str, float]]:
        """KL in the reward: ``r - kl_coef * sum_t kl(sampler logp, reference logp)`` over each
        datum's sampled tokens, then the advantages of the penalised returns; with the mean KL
        and penalised return as metrics."""
        ref = self.compute_ref_logprobs(data, temperature)
        width = max(len(d.tokens) for d in data)

        def padded(rows: list[list[float]]) -> torch.Tensor:
            return torch.tensor([r + [0.0] * (width - len(r)) for r in rows], dtype=torch.float32)

        penalised_N, kl_N = kl_penalized_rewards(
            torch.tensor(rewards, dtype=torch.float32),
            padded([d.old_logprobs for d in data]),
            padded(ref),
            padded([[float(m) for m in d.loss_mask] for d in data]),
            kl_coef,
            kl_estimator,
        )
        advantages_N = get_advantage_estimator(estimator)(penalised_N, torch.tensor(group_ids))
        metrics = {"kl_ref": float(kl_N.mean()), "reward_penalised": float(penalised_N.mean())}
        return advantages_N.tolist(), metrics

    def optim_step(self) -> dict[str, float]:
        """Clip gradients, take one AdamW step, bump the weights version."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        grad_norm = torch.nn.utils.clip_grad_norm_(params, self.spec.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.version += 1
        return {"grad_norm": float(grad_norm), "weights_version": self.version}

    @torch.no_grad()
    def compute_logprobs(self, data: list[Datum], temperature: float = 1.0) -> list[list[float]]:
        """Log-probability of every token given its prefix (first token: 0.0)."""
        b = self._batch(data)
        logprobs_B_T = self._logprobs(b, temperature)
        return [[0.0] + logprobs_B_T[i, : len(d.tokens) - 1].tolist() for i, d in enumerate(data)]

    def get_weights(self) -> tuple[dict[str, torch.Tensor], int]:
        """The trainable weights (adapter only for LoRA) and their version, for weight sync."""
        return trainable_state(self.model, self.spec.lora.enabled, self.adapter), self.version

    def get_weights_version(self) -> int:
        """Optimiser steps taken (restored from checkpoints): the version ``get_weights`` gives."""
        return self.version

    def save_state(self, storage_url: str, prefix: str, step: int, meta: dict[str, Any]) -> str:
        """Commit a resumable checkpoint: trainable weights, optimiser, RNG, step, ``meta``;
        written to a local folder and streamed from there (no bytes copy of the state)."""
        from flowrl.infra.storage import Storage, commit_checkpoint

        meta = {**meta, "weights_version": self.version, "lora": self.spec.lora.enabled}
        with tempfile.TemporaryDirectory(prefix="flowrl-checkpoint-") as tmp:
            files = {name: Path(tmp, name) for name in CHECKPOINT_FILES}
            save_safetensors_file(
                trainable_state(self.model, self.spec.lora.enabled, self.adapter),
                files["weights.safetensors"],
            )
            torch.save(self.optimizer.state_dict(), files["optimizer.pt"])
            torch.save({"torch": torch.get_rng_state()}, files["rng.pt"])
            return commit_checkpoint(Storage(storage_url), prefix, step, files, meta)

    def load_state(self, storage_url: str, prefix: str) -> dict[str, Any] | None:
        """Load the latest complete checkpoint under ``prefix``; its meta, or None if none. Its
        files are downloaded to a local folder and read from there (``save_state``)."""
        from flowrl.infra.storage import Storage, load_latest_checkpoint

        with tempfile.TemporaryDirectory(prefix="flowrl-checkpoint-") as tmp:
            latest = load_latest_checkpoint(Storage(storage_url), prefix, into=Path(tmp))
            if latest is None:
                return None
            step, files, meta = latest
            state = load_safetensors_file(files["weights.safetensors"])
            load_trainable_state(self.model, state, self.spec.lora.enabled, self.adapter)
            del state
            self.optimizer.load_state_dict(torch.load(files["optimizer.pt"], weights_only=True))
            torch.set_rng_state(torch.load(files["rng.pt"], weights_only=True)["torch"])
        self.version = int(meta.get("weights_version", step))
        return {**meta, "step": step}

    def export_pretrained(self, storage_url: str, rel: str) -> str:
        """Write the policy as a plain HF folder (LoRA merged) under ``rel``; return its URI.
        With LoRA the folder also keeps the adapter itself and its base (``LORA_EXPORT``), so
        the version can run as an adapter on a shared worker of that base."""
        from flowrl.infra.storage import Storage

        storage = Storage(storage_url)
        model = self.model
        if self.spec.lora.enabled:
            model = self._merged_copy()
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp)
            copy_model_files(self.model_path, tmp)  # tokenizer, template, generation config
            if self.spec.lora.enabled:
                write_lora_export(
                    tmp,
                    trainable_state(self.model, True, self.adapter),
                    self.spec.model_uri,
                    self.spec.lora.model_dump(mode="json"),
                )
            storage.put_dir(tmp, rel)
        return storage.uri(rel)

    def _merged_copy(self) -> torch.nn.Module:
        """A plain model with the adapter merged in; the live adapter and RNG are untouched."""
        from peft import get_peft_model, set_peft_model_state_dict

        with torch.random.fork_rng(devices=[]):  # the throwaway adapter init draws randoms
            copy = get_peft_model(load_causal_lm(self.model_path), lora_config(self.spec))
        set_peft_model_state_dict(copy, trainable_state(self.model, True, self.adapter))
        return copy.merge_and_unload()


def _one_pass(
    trainer: TorchTrainer,
    data: list[Datum],
    loss_fn: str,
    options: dict[str, Any],
    temperature: float,
    correction: dict[str, Any] | None,
    kl: tuple[float, str, str],
    scales: tuple[float, float],
) -> tuple[float, dict[str, float]]:
    """One forward and backward pass of ``TorchTrainer.forward_backward`` over ``data``: the
    loss times ``scales[0]`` (its KL term, ``kl`` = coefficient, estimator, aggregation, times
    ``scales[1]``), so that the passes' gradients sum to the whole batch's; the pass's loss and
    metrics."""
    kl_coef, kl_estimator, kl_agg = kl
    b = trainer._batch(data)
    logprobs_B_T = trainer._loss_logprobs(data, b, temperature)
    sampled_B_T = b["mask"] * b["has_old"].unsqueeze(-1)  # tokens with sampler log-probs
    if loss_fn == "cross_entropy":
        loss = -(logprobs_B_T * b["mask"]).sum() / b["mask"].sum().clamp(min=1)
        metrics: dict[str, float] = {}
    else:
        old_B_T, weights_B_T, metrics = _off_policy_correction(
            logprobs_B_T, b, sampled_B_T, correction
        )
        policy_loss = get_policy_loss(loss_fn)
        loss, loss_metrics = policy_loss(
            logprobs_B_T, old_B_T, b["advantages"], b["mask"], weights_B_T=weights_B_T, **options
        )
        metrics |= loss_metrics
    if scales[0] != 1.0:  # rows left out (advantage 0) or in other passes: their part
        loss = loss * scales[0]
    if kl_coef > 0:
        ref_B_T = trainer._reference_logprobs(b, temperature)
        kl_B_T = KL_ESTIMATORS[kl_estimator](logprobs_B_T, ref_B_T)
        kl_term = LOSS_AGGREGATIONS[kl_agg](kl_B_T, b["mask"])
        loss = loss + kl_coef * kl_term * scales[1]
        metrics["kl_ref"] = float(kl_term.detach())
    if bool(b["has_old"].any()):
        metrics["mismatch_kl"] = float(mismatch_kl(logprobs_B_T, b["old"], sampled_B_T))
    trainer._backward(loss)
    return float(loss.detach()), metrics
