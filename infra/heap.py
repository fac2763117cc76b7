"""A process's long-lived objects out of the cyclic garbage collector's walks (``gc.freeze``).

A process that holds a model, or imports Prefect, MLflow, torch and transformers, keeps a
million or more container objects for its whole life. Python's full (generation-2) collection
walks every one of them each time it runs: ~250 ms on a policy worker with torch and
transformers loaded, ~110 ms in a job's flow process, a pause in whichever step triggers it (a
0.34M job's rollout through its colocated worker: 300 ms against 95). Frozen, they are skipped:
the same collection then takes ~25 ms. Objects made later are collected as before.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def freeze_heap() -> None:
    """Collect what is garbage now, then freeze everything still alive: for a worker, after
    it has built its backend (``backends.policy.workers``)."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """``freeze_heap`` while inside (a job's steps: ``JobRun.steps``), unfrozen after, so that
    what the process drops later (a finished job's objects, where one process runs several)
    is collected again."""
    freeze_heap()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def refrozen() -> Iterator[None]:
    """Around replacing what a process froze (a worker's restart): unfrozen, so the old
    objects' cycles are collected once dropped, and ``freeze_heap`` again after."""
    gc.unfreeze()
    try:
        yield
    finally:
        freeze_heap()
