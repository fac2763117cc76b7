"""Data contracts of the model backends (the Tinker-style verbs' inputs and outputs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, Field

from flowrl.infra.configfile import STRICT_MODEL_CONFIG

Precision = Literal["auto", "float32", "bfloat16"]
"""``resources.dtype`` / ``WorkerSpec.dtype``; auto = bfloat16 on CUDA, float32 elsewhere
(``backends.models.precision``)."""

# The names ``backends.engines.algorithms`` registers, for validating configs where torch is not
# imported (the flow's process); tests/test_algorithms.py checks they equal the registries' keys.
ADVANTAGE_NAMES = ("grpo", "dr_grpo", "rloo", "reinforce_pp")
POLICY_LOSS_NAMES = ("ppo_clip", "cispo", "gspo")
LOSS_AGGREGATION_NAMES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3")


@dataclass
class Datum:
    """One training sequence for ``forward_backward``.

    ``tokens``, ``loss_mask`` and ``old_logprobs`` have the sequence length T; ``loss_mask``
    selects the tokens that carry loss. ``advantage`` (one per sequence: outcome rewards) and
    ``old_logprobs`` (the sampler's, 0.0 where the mask is 0) are only read by policy losses.
    ``images`` (vision-language models) are the encoded images whose image tokens ``tokens``
    holds, in order (``Trajectory.images``).
    """

    tokens: list[int]
    loss_mask: list[int]
    advantage: float = 0.0
    old_logprobs: list[float] = field(default_factory=list)
    images: list[bytes] = field(default_factory=list)


ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)
"""The module groups a LoRA adapter may train (a Tinker ``LoraConfig`` names them by group)."""


class LoraSettings(BaseModel, title="LoRA"):
    """LoRA adapter settings (peft), of a job's policy (``model.lora``) and of a Tinker API
    training model alike (``engines.tinker.types.tinker_lora``: the Tinker SDK's ``LoraConfig`` as
    these). Disabled means full-parameter training."""

    model_config = STRICT_MODEL_CONFIG

    enabled: bool = Field(default=False, description="Train a LoRA adapter instead of all weights.")
    r: int = Field(default=16, ge=1, le=1024, description="LoRA rank.")
    alpha: int = Field(default=32, ge=1, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="Dropout on the LoRA path.")
    target_modules: list[str] = Field(
        default=[*ATTN_MODULES, *MLP_MODULES],
        min_length=1,
        description="Module names that get adapters.",
    )


class WorkerSpec(BaseModel):
    """How a sampler or trainer worker is built (everything an actor needs, as small data)."""

    model_config = STRICT_MODEL_CONFIG

    model_uri: str = Field(description="HF model folder: local path, fsspec URL or models:/ URI.")
    cache_dir: str = Field(description="Local folder where remote models are copied.")
    lora: LoraSettings = Field(default_factory=LoraSettings)
    learning_rate: float = Field(default=3e-4, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    seed: int = Field(default=0, description="Seed for weights that are initialised (LoRA).")
    torch_threads: int = Field(default=1, ge=1, description="torch intra-op threads per worker.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="Device for the weights; auto = cuda when visible."
    )
    dtype: Precision = Field(
        default="auto",
        description="Compute precision (auto = bfloat16 on CUDA, float32 on CPU); the trainer "
        "keeps float32 master weights (backends.models.precision).",
    )


@dataclass(frozen=True)
class JobTenancy:
    """A job's tenancy of a shared base-model worker: its sampler and trainer as LoRA adapters
    on the worker's base, built from ``specs`` (by role: ``sampler``, ``trainer``); called by
    role."""

    specs: dict[str, WorkerSpec]


@dataclass(frozen=True)
class ModelTenancy:
    """A Tinker API training model's tenancy of a shared base-model worker: one LoRA adapter
    with its AdamW and RNG on the worker's base (``backends.engines.tinker.model.TinkerModel``);
    called with the role ``model``."""

    lora: LoraSettings
    seed: int | None = None


Tenancy = JobTenancy | ModelTenancy
"""What a tenant of a shared worker holds there (``SharedWorker.join``)."""
