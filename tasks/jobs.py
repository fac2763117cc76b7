"""Deprecated: the job schemas live in ``flowrl.tasks.schemas``; import them from there.

This alias keeps ``from flowrl.tasks.jobs import RLJobConfig`` working in users' code (the same
classes, re-exported) and warns once, when first imported. Nothing in flowrl imports it.
"""

from __future__ import annotations

import warnings

from flowrl.tasks import schemas
from flowrl.tasks.schemas import *  # noqa: F403 - the very same names, re-exported

__all__ = schemas.__all__

warnings.warn(
    "flowrl.tasks.jobs is deprecated: import the job schemas from flowrl.tasks.schemas",
    DeprecationWarning,
    stacklevel=2,
)
