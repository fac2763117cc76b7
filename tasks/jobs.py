"""Deprecated: the job schemas live in ``flowrl.tasks.schemas``; import them from there.

This alias keeps ``from flowrl.tasks.jobs import RLJobConfig`` working in users' code (the same
classes, re-exported) and warns once, when first imported. Nothing in flowrl imports it.
"""

from __future__ import annotations

import warnings

from flowrl.tasks.schemas import (
    JOB_KINDS,
    JOB_NAME_PATTERN,
    MODEL_NAME_PATTERN,
    SUCCESS_RULE,
    AlgorithmSection,
    EnvDataSection,
    EnvSection,
    EvalJobConfig,
    InferenceJobConfig,
    JobConfig,
    ModelSection,
    NoCredentials,
    ResourcesSection,
    RetrainConfig,
    RLJobConfig,
    RolloutSection,
    RowFile,
    ScheduleSection,
    SelfPlayJobConfig,
    SFTDataSection,
    SFTJobConfig,
    SFTTrainSection,
    TinkerSessionConfig,
    TrainingJobConfig,
    WarmupSection,
    load_job,
)

__all__ = [
    "JOB_KINDS",
    "JOB_NAME_PATTERN",
    "MODEL_NAME_PATTERN",
    "SUCCESS_RULE",
    "AlgorithmSection",
    "EnvDataSection",
    "EnvSection",
    "EvalJobConfig",
    "InferenceJobConfig",
    "JobConfig",
    "ModelSection",
    "NoCredentials",
    "RLJobConfig",
    "ResourcesSection",
    "RetrainConfig",
    "RolloutSection",
    "RowFile",
    "SFTDataSection",
    "SFTJobConfig",
    "SFTTrainSection",
    "ScheduleSection",
    "SelfPlayJobConfig",
    "TinkerSessionConfig",
    "TrainingJobConfig",
    "WarmupSection",
    "load_job",
]

warnings.warn(
    "flowrl.tasks.jobs is deprecated: import the job schemas from flowrl.tasks.schemas",
    DeprecationWarning,
    stacklevel=2,
)
