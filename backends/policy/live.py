"""A running job's policy, reachable by the job's name while it runs.

A job keeps a record of where its policy's workers are, ``<job prefix>/live.json`` (the job's
own storage prefix, under its namespace's), written when the job's policy starts
(``flows.lifecycle.JobRun.start_policy``) and removed before its workers stop. A server on the
same storage and the same Ray cluster (the OpenAI-compatible endpoint, ``model: job:<name>``)
reads the record of the caller's namespace and samples the policy's first sampler, between
the job's own calls: what it samples is the policy as it is now, after the job's last weight
sync.

The record names the workers; nothing is read out of actor names (a namespace with a dash
would make ``<namespace>-<job>-…`` ambiguous). It is written by the job and read only by
servers of its storage: a request names a job, never a record, a path or an actor."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from flowrl.backends.policy.actors import ColocatedPolicy, PolicyRef, SharedPolicy, SplitPolicy
from flowrl.infra.storage import Storage

RECORD = "live.json"
_KINDS = {cls.__name__: cls for cls in (SplitPolicy, ColocatedPolicy, SharedPolicy)}


@dataclass(frozen=True)
class LivePolicy:
    """A running job's policy as its record says: the workers, the model folder its weights
    started from (its tokenizer and chat format), the Ray cluster the workers are on."""

    policy: PolicyRef | None
    """None where the workers run inside the job's own process (no Ray to reach them on)."""
    model_uri: str
    ray_address: str
    since: float


def publish(storage: Storage, prefix: str, policy: PolicyRef, model_uri: str) -> None:
    """Record ``policy`` (started from ``model_uri``) as the running policy of the job at
    ``prefix``."""
    import ray

    record: dict[str, Any] = {"model_uri": model_uri, "since": time.time(), "kind": "local"}
    if not policy.local:
        record |= {
            "kind": type(policy).__name__,
            "samplers": list(policy.samplers),
            "trainer": policy.trainer,
            "tenant": getattr(policy, "tenant", ""),
            "ray": ray.get_runtime_context().gcs_address,
        }
    storage.write_json(f"{prefix}/{RECORD}", record)


def withdraw(storage: Storage, prefix: str) -> None:
    """The job at ``prefix`` has no running policy any more."""
    storage.delete(f"{prefix}/{RECORD}")


def find(storage: Storage, prefix: str) -> LivePolicy | None:
    """The running policy the job at ``prefix`` recorded, or None."""
    rel = f"{prefix}/{RECORD}"
    if not storage.exists(rel):
        return None
    record = storage.read_json(rel)
    kind = record.get("kind")
    if kind == "local":
        policy = None
    elif kind in _KINDS:
        fields: dict[str, Any] = {
            "samplers": tuple(str(s) for s in record["samplers"]),
            "trainer": str(record["trainer"]),
        }
        if kind == SharedPolicy.__name__:
            fields["tenant"] = str(record["tenant"])
        policy = _KINDS[kind](**fields)
    else:
        raise ValueError(f"{rel}: unknown policy kind {kind!r}")
    return LivePolicy(
        policy, str(record["model_uri"]), str(record.get("ray", "")), float(record["since"])
    )
