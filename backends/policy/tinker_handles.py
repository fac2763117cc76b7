"""The Tinker service's handles on its training models, wherever they live: a ``ModelHandle``
runs one of the model's methods and closes it. Placements (``backends.policy.placement``) start the
models and give these back:

- ``LocalHandle``: a ``TinkerModel`` in the service's process (``InProcess``);
- ``RayHandle``: a session flow run's Ray actor (``OwnWorkers``; ``backends.engines.tinker.actor``);
- ``SharedModelHandle``: a tenant of its base model's shared worker (``SharedTenant``;
  ``backends.engines.shared_worker``), next to ``rl-train`` jobs' adapters;
- ``EngineHandle``: a sampling model on a vLLM engine's actor (``VLLMEngines``).
"""

from __future__ import annotations

import threading
from typing import Any, Protocol

import ray

from flowrl.infra.settings import RAY_NAMESPACE, get_settings

_working_for = threading.local()


def work_for(request_id: str | None) -> None:
    """This thread now works for the request ``request_id`` (None: for none): the model calls
    it makes are keyed ``<request id>/<n>``, in order."""
    _working_for.request_id = request_id
    _working_for.calls = 0


def request_key() -> str | None:
    """The next call's key for the request this thread works for (None outside a request)."""
    request_id = getattr(_working_for, "request_id", None)
    if request_id is None:
        return None
    _working_for.calls += 1
    return f"{request_id}/{_working_for.calls}"


class ModelHandle(Protocol):
    """Where one training model's ``TinkerModel`` lives; ``call`` runs one of its methods."""

    info: dict[str, Any]

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any: ...

    def close(self) -> None: ...


class LocalHandle:
    """The service's handle on a model in its own process."""

    def __init__(self, model: Any):
        self.model = model
        self.info = {"vocab_size": model.vocab_size, "context_length": model.context_length}

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return getattr(self.model, method)(*args, **kwargs)

    def close(self) -> None:
        if self.model is not None:
            self.model.close()  # its adapter leaves the shared base
            self.model = None


class RayHandle:
    """The service's handle on a session's actor."""

    def __init__(self, actor: Any, flow_run_id: str | None, info: dict[str, int]):
        self.actor = actor
        self.flow_run_id = flow_run_id  # None: found again by a restarted service
        self.info = info

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """``method`` on the actor, keyed by the request this thread works for, if any
        (``request_key``): the actor runs a keyed call once."""
        return _answer(self.actor.call.remote(method, args, kwargs, request_key()))

    def close(self) -> None:
        try:
            ray.get(self.actor.close.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - an actor already gone is closed
            pass


class SharedModelHandle:
    """The service's handle on a Tinker model that is a tenant of a shared worker; ``slot``
    (its adapter slot, a context) is given back when it closes."""

    def __init__(self, actor: Any, worker: str, model_id: str, info: dict, slot: Any):
        self.actor = actor
        self.worker = worker
        self.model_id = model_id
        self.info = info
        self._slot = slot

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _answer(self.actor.call_as.remote(self.model_id, "model", method, *args, **kwargs))

    def close(self) -> None:
        """Unload the model (the worker goes on for its others) and give its slot back."""
        try:
            ray.get(self.actor.do.remote("leave", self.model_id), timeout=30)
        except Exception:  # noqa: BLE001 - a worker already gone holds nothing
            pass
        finally:
            self._slot.close()


class EngineHandle:
    """The service's handle on a sampling model in a sampler actor (``VLLMEngines``: a vLLM
    engine, ``backends.engines.tinker.vllm_sampling``)."""

    def __init__(self, actor: Any):
        self.actor = actor
        self.info = self.call("describe")

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _answer(self.actor.call.remote(method, *args, **kwargs))

    def close(self) -> None:
        ray.kill(self.actor)


def _answer(ref: Any) -> Any:
    """The call's result, or the error the model raised (a bad input stays a 4xx)."""
    from ray.exceptions import RayTaskError

    try:
        return ray.get(ref)
    except RayTaskError as e:
        cause = getattr(e, "cause", None)
        raise (cause if isinstance(cause, Exception) else e) from None


def connect_service_ray() -> None:
    """This process (the service) joins the stack's Ray cluster, in flowrl's namespace."""
    if ray.is_initialized():
        return
    address = get_settings().ray_address
    if address is None:
        raise RuntimeError("sessions need a Ray cluster: set FLOWRL_RAY_ADDRESS (flowrl stack up)")
    ray.init(address=address, namespace=RAY_NAMESPACE, log_to_driver=False)


class Answered:
    """A handle that answers one call with a result already had: the result a restore got
    for a call that its journal's replay asks for again (``Registry.run_on``)."""

    def __init__(self, result: Any, info: dict[str, Any]):
        self.result = result
        self.info = info

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self.result

    def close(self) -> None:
        pass


def actor_lost(err: BaseException) -> bool:
    """``err`` says the model's actor is gone (it died, or its node or Ray head did)."""
    from ray.exceptions import RayActorError

    return isinstance(err, RayActorError)


def ray_cluster_gone() -> str | None:
    """Why the Ray cluster this process joined is gone, or None (it answers, or this process
    joined none). A Ray head started again at the same address is a new cluster: this
    process's calls to it fail (``WrongClusterID``) or wait for ever, and only a new process
    can join it. (A question to the cluster's key-value store, the cheapest one that fails
    rather than aborting the process: ``ray.nodes()`` aborts it.)"""
    if not ray.is_initialized():
        return None
    from ray.experimental import internal_kv

    try:
        internal_kv._internal_kv_exists(b"flowrl-probe")
    except Exception as err:  # noqa: BLE001 - any failure of the question is the answer
        return f"{type(err).__name__}: {err}"[:300]
    return None
