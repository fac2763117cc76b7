"""The Ray actor that holds a Tinker training model when sessions are flowrl jobs.

The ``tinker-session`` flow run (``flows/tinker_session.py``) starts it, named
``tinker-<model>`` in flowrl's Ray namespace, where the service's ``OwnWorkers`` placement
finds it. One call at a time runs on the model, while ``poll`` (the flow run's supervision)
waits for the metrics it records (loss per ``forward_backward``, tokens, learning rate and
gradient norm per ``optim_step``) or for ``close`` (the service unloads the model): then the
run ends and its GPU slots are freed. The actor outlives a restart of the service: a call made
with a key runs once, so the restarted service's replay of its journal (``journal.py``) gets
the answers of calls that had already run.
"""

from __future__ import annotations

import threading
from typing import Any

import ray

from flowrl.backends.types import LoraSettings

ACTOR_PREFIX = "tinker-"
KEPT_ANSWERS = 256
"""Results of keyed calls kept for a replay (far more than a client has in flight)."""


def actor_name(model_id: str, generation: int = 0) -> str:
    """The Ray actor name of a training model's actor; a model the service made again
    (``generation`` > 0: ``Training.restore``) has a name of its own each time."""
    name = ACTOR_PREFIX + model_id.replace(":", "-")
    return f"{name}-g{generation}" if generation else name


@ray.remote(max_concurrency=4)
class TinkerActor:
    """A ``TinkerModel`` in a Ray worker: one call at a time on the model, while ``poll``
    (the flow run's) waits for metrics or the end."""

    def __init__(self, base_uri: str, lora: LoraSettings, seed: int | None, cache_dir: str):
        from flowrl.backends.engines.tinker.model import TinkerModel
        from flowrl.backends.models.tinker_checkpoints import resolve_base_model

        self.model = TinkerModel(resolve_base_model(base_uri, cache_dir), lora, seed)
        self.lock = threading.Lock()
        self.changed = threading.Condition()
        self.metrics: list[dict[str, float]] = []
        self.closed = False
        self.step = 0
        self.answers: dict[str, Any] = {}  # key -> result of the last KEPT_ANSWERS keyed calls

    def info(self) -> dict[str, int]:
        return {"vocab_size": self.model.vocab_size, "context_length": self.model.context_length}

    def call(self, method: str, args: tuple, kwargs: dict, key: str | None = None) -> Any:
        """``method`` on the model. A call with a ``key`` runs once: the same key again (the
        service replaying its journal after a restart) answers the first call's result."""
        with self.lock:
            if key is not None and key in self.answers:
                return self.answers[key]
            if self.closed:
                raise RuntimeError("this model is unloaded")
            out = getattr(self.model, method)(*args, **kwargs)
            self._record(method, args, out)
            if key is not None:
                self.answers[key] = out
                while len(self.answers) > KEPT_ANSWERS:
                    self.answers.pop(next(iter(self.answers)))
        return out

    def _record(self, method: str, args: tuple, out: Any) -> None:
        row: dict[str, float] = {}
        if method == "forward_backward" and not args[3]:  # forward-only calls train nothing
            row = {"train/loss_sum": out.metrics["loss:sum"]}
            row["train/tokens"] = float(sum(len(d.tokens) for d in args[0]))
            row["train/datums"] = float(len(args[0]))
        elif method == "optim_step":
            self.step += 1
            row = {"optim/lr": out["learning_rate:mean"], "optim/grad_norm": out["grad_norm:mean"]}
        if row:
            with self.changed:
                self.metrics.append({**row, "step": float(self.step)})
                self.changed.notify_all()

    def poll(self, timeout: float) -> tuple[bool, list[dict[str, float]]]:
        """The metrics recorded since the last poll, and whether the model is unloaded."""
        with self.changed:
            if not self.metrics and not self.closed:
                self.changed.wait(timeout)
            rows, self.metrics = self.metrics, []
            return self.closed, rows

    def close(self) -> None:
        with self.changed:
            self.closed = True
            self.changed.notify_all()
