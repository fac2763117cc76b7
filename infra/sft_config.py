"""The SFT job config: one frozen pydantic model, validated at the edge (like ``RLJobConfig``).

A chat dataset (JSONL/JSON/parquet rows ``{"messages": [...]}``, local or any fsspec URL) trains
a model on its assistant tokens only; the result is evaluated by greedy exact match on held-out
conversations and registered in MLflow.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from environments.data import ROW_FORMATS
from infra.config import ModelSection, ResourcesSection, _Section


class SFTDataSection(_Section):
    train: str = Field(
        description="Chat rows {'messages': [...]}: a .jsonl/.json/.parquet path or fsspec URL "
        "(s3://…)."
    )
    eval: str | None = Field(
        default=None, description="Held-out chat rows (same format); unset = split off `train`."
    )
    eval_size: int = Field(
        default=200,
        ge=1,
        description="Rows held out of `train` for evaluation when `eval` is unset.",
    )

    @field_validator("train", "eval")
    @classmethod
    def _known_format(cls, v: str | None) -> str | None:
        if v is not None and not v.split("?", 1)[0].lower().endswith(ROW_FORMATS):
            raise ValueError(f"{v!r}: expected one of {', '.join(ROW_FORMATS)}")
        return v


class SFTTrainSection(_Section):
    steps: int = Field(default=300, ge=1, description="Optimiser steps.")
    batch_size: int = Field(default=32, ge=1, description="Conversations per step.")
    learning_rate: float = Field(default=3e-3, gt=0, le=1, description="AdamW learning rate.")
    max_grad_norm: float = Field(default=1.0, gt=0, description="Gradient clipping norm.")
    eval_every: int = Field(default=100, ge=1, description="Steps between held-out evaluations.")
    max_new_tokens: int = Field(
        default=16, ge=1, description="Token budget of a generated answer at evaluation."
    )


class SFTJobConfig(_Section):
    """A supervised fine-tuning job: chat data + model → a registered policy."""

    name: str = Field(
        default="sft",
        pattern=r"^[a-z0-9][a-z0-9-]{0,62}$",
        description="Job name: storage prefix and MLflow run name.",
    )
    seed: int = Field(default=0, description="Seed of data order, split and initialisation.")
    data: SFTDataSection = Field(description="Chat datasets.")
    model: ModelSection = Field(default_factory=ModelSection, description="Model to train.")
    train: SFTTrainSection = Field(default_factory=SFTTrainSection, description="Optimisation.")
    resources: ResourcesSection = Field(default_factory=ResourcesSection, description="Workers.")
    experiment: str = Field(default="flowrl-sft", min_length=1, description="MLflow experiment.")
    register_as: str | None = Field(
        default=None, description="Registered model name in MLflow; unset = the job name."
    )

    @property
    def registered_model_name(self) -> str:
        return self.register_as or self.name


def load_sft_config(path: str | Path | None, overrides: list[str] | None = None) -> SFTJobConfig:
    """Read a YAML SFT config, apply ``--set``-style overrides, validate (``ConfigError``)."""
    from infra.config import load_config

    return load_config(path, overrides, SFTJobConfig)
