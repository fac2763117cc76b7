"""A cheap job for exercising the scheduler: hold GPU slots, sleep, report when they were held.

It goes through the same admission as a training job (work queue and pool limits, then
``resources.gpus`` slots of the strict ``gpu`` limit) without loading a model, so load tests
and smoke tests of a deployment take seconds.
"""

from __future__ import annotations

import time

from prefect import flow
from prefect.artifacts import create_table_artifact

from flowrl.infra.scheduler import gpu_slots


@flow(name="gpu-probe", log_prints=True)
def gpu_probe(seconds: float = 1.0, gpus: int = 1) -> dict[str, float]:
    """Hold ``gpus`` GPU slots for ``seconds``; returns (and records) when they were held."""
    with gpu_slots(gpus):
        held = {"acquired": time.time()}
        time.sleep(seconds)
        held["released"] = time.time()
    create_table_artifact([{**held, "gpus": gpus}], key="gpu-probe", description="GPU slots held")
    return held
