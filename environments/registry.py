"""Environments by name: each name maps to the task config that builds its envs and data."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from flowrl.environments.arithmetic import ArithmeticTask
from flowrl.environments.geometry import GeometryTask
from flowrl.environments.gomoku import GomokuTask
from flowrl.environments.tool_math import ToolMathTask
from flowrl.environments.types import TaskConfig

ENVIRONMENTS: dict[str, type[BaseModel]] = {
    "arithmetic": ArithmeticTask,
    "tool_math": ToolMathTask,
    "gomoku": GomokuTask,
    "geometry": GeometryTask,
}
"""Name → task-config class (``environments.types.TaskConfig``)."""


def make_task(name: str, params: dict[str, Any] | None = None) -> TaskConfig:
    """Validate ``params`` into the task config registered as ``name``.

    Raises ``ValueError`` listing the known names for an unknown ``name``, and pydantic's
    ``ValidationError`` (naming the field) for bad ``params``.
    """
    try:
        task_cls = ENVIRONMENTS[name]
    except KeyError:
        known = ", ".join(sorted(ENVIRONMENTS))
        raise ValueError(f"unknown environment {name!r}; known environments: {known}") from None
    return task_cls.model_validate(params or {})
