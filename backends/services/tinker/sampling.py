"""The Tinker service's samplers: a sampler of a live model's snapshot, of a saved path or of
a base model, and ``sample`` on it. A saved path or a base model is sampled by a pool model of
its base and adapter shape, shared by every caller (it holds no one's training state), on the
sampling placement (this process, or vLLM engines: ``engine_samples``)."""

from __future__ import annotations

import secrets
from typing import Any

from flowrl.backends.engines.tinker.types import (
    ImageInput,
    PromptScoring,
    SampleParams,
    check_fits,
    read_tinker_lora,
    tinker_lora,
    tinker_lora_config,
)
from flowrl.backends.models.tinker_checkpoints import not_found
from flowrl.backends.policy.placement import Placement
from flowrl.backends.policy.tinker_handles import ModelHandle
from flowrl.backends.services.tinker.checkpoints import Checkpoints
from flowrl.backends.services.tinker.registry import Registry
from flowrl.backends.services.tinker.state import Model, Sampler, Session, live
from flowrl.backends.services.tinker.wire import write_sample_response
from flowrl.backends.types import LoraSettings
from flowrl.infra.serving import ServiceError


class Sampling:
    """Samplers by id, each its namespace's, and the pool models that serve saved paths."""

    def __init__(self, placement: Placement, registry: Registry, checkpoints: Checkpoints):
        self.placement = placement
        # A sampling engine of its own (vLLM): every saved sampler weights, a live model's
        # too, is sampled there, never by a training model's worker.
        self.engine_samples = placement.kind == "vllm-engines"
        self.registry = registry
        self.checkpoints = checkpoints
        self.calls = registry.calls
        self.lock = registry.lock
        self.samplers: dict[str, Sampler] = {}
        self.pool: dict[tuple, Model] = {}  # samplers of saved paths and base models

    def pool_model(self, base_model: str, lora: LoraSettings, seed: int | None = None) -> Model:
        """A model of this service for sampling saved paths of ``lora``'s shape (or the base
        model alone), shared by every caller: it holds no one's training state."""
        key = (base_model, tuple(sorted(tinker_lora_config(lora, seed).items())))
        with self.lock:
            model = self.pool.get(key)
            if model is None:
                model = Model(f"pool-{len(self.pool)}", None, "", base_model, lora, seed)
                self.pool[key] = model
                uri = self.registry.base_uri(base_model)
                spec = {
                    "model_id": model.model_id,
                    "namespace": None,
                    "base_model": base_model,
                    "base_uri": uri,
                    "lora": lora,
                    "seed": seed,
                    "session_id": "",
                }

                def start() -> None:
                    try:
                        model.handle = self.placement.start_model(spec)
                    except Exception as err:
                        model.ended = f"its start failed: {type(err).__name__}: {err}"[:500]
                        raise

                model.worker.submit(start)
        return model

    def add(self, namespace: str | None, session: Session, sampler: Sampler) -> str:
        with self.lock:
            self.samplers[sampler.sampler_id] = sampler
            session.samplers.append(sampler.sampler_id)
        self.calls.note(
            {
                "op": "sampler",
                "sampler_id": sampler.sampler_id,
                "ns": namespace,
                "session_id": session.session_id,
                "base_model": sampler.base_model,
                "model_path": sampler.model_path,
                "model_id": sampler.model_id,
                "weights": sampler.weights,
            }
        )
        return sampler.sampler_id

    def sampler(self, namespace: str | None, sampler_id: Any) -> Sampler:
        with self.lock:
            s = self.samplers.get(sampler_id) if isinstance(sampler_id, str) else None
        if s is None or s.namespace != namespace:
            raise not_found(f"no sampler {str(sampler_id)[:80]!r}")
        return s

    def from_path(self, namespace: str | None, session: Session, path: str) -> str:
        """A sampler of the saved sampler weights at ``path``: on the live model that saved
        them, else on a pool model."""
        run_id, kind, folder = self.checkpoints.parse_path(namespace, path, public=True)
        record = self.checkpoints.record(folder)
        lora, seed = read_tinker_lora(record["lora"])
        with self.lock:
            model = self.registry.models.get(run_id)
        serves = model is not None and not model.ended and model.namespace == namespace
        if serves and not self.engine_samples:
            target = model
        else:
            target = self.pool_model(record["base_model"], lora, seed)
        data = self.checkpoints.storage.read_bytes(f"{folder}/adapter.safetensors")
        target.worker.submit(lambda: live(target).call("add_snapshot_bytes", path, data)).result()
        sampler = Sampler(
            f"{session.session_id}:sample:{secrets.token_hex(4)}",
            namespace,
            record["base_model"],
            path,
            target.model_id if target is model else None,
            path,
            pool=target,
        )
        return self.add(namespace, session, sampler)

    def restore(self, e: dict) -> None:
        """A sampler of the journal (``recover``), on the model it sampled; dropped when its
        checkpoint was deleted meanwhile."""
        sampler = Sampler(
            e["sampler_id"], e["ns"], e["base_model"], e["model_path"], e["model_id"], e["weights"]
        )
        try:
            if e["model_path"] and e["model_id"] is None:  # a saved path on a pool model
                _, _, folder = self.checkpoints.parse_path(e["ns"], e["model_path"], public=True)
                record = self.checkpoints.record(folder)
                lora, seed = read_tinker_lora(record["lora"])
                target = self.pool_model(record["base_model"], lora, seed)
                data = self.checkpoints.storage.read_bytes(f"{folder}/adapter.safetensors")
                path = e["model_path"]
                target.worker.submit(lambda: live(target).call("add_snapshot_bytes", path, data))
                sampler.pool = target
            elif e["model_id"] is not None and e["model_id"] in self.registry.models:
                sampler.pool = self.registry.models[e["model_id"]] if e["model_path"] else None
        except ServiceError:
            return  # its checkpoint was deleted meanwhile: the sampler is gone
        self.samplers[sampler.sampler_id] = sampler
        self.registry.sessions[e["session_id"]].samplers.append(sampler.sampler_id)

    def target(self, sampler: Sampler) -> Model:
        """The model that samples for ``sampler``."""
        if sampler.pool is not None:
            return sampler.pool
        if sampler.model_id is not None:
            return self.registry.model(sampler.namespace, sampler.model_id)
        return self.pool_model(sampler.base_model, tinker_lora(rank=1))

    def snapshot_for_sampler(self, namespace: str | None, model_id: Any) -> tuple[str, str]:
        """``save_weights_for_sampler`` without a path: a sampler of the model's weights as
        they are now, kept on the model (no storage)."""
        model = self.registry.model(namespace, model_id)
        session = self.registry.session(namespace, model.session_id)
        with self.lock:
            model.snapshots += 1
            key = f"snapshot-{model.snapshots}"
        if self.engine_samples:  # one engine samples every model's snapshots: keys of the model
            key = f"{model.model_id}/{key}"
        sampler_id = self.add(
            namespace,
            session,
            Sampler(
                f"{model.model_id}:snapshot:{model.snapshots}",
                namespace,
                model.base_model,
                None,
                model.model_id,
                key,
            ),
        )

        if self.engine_samples:  # the adapter as it is now goes to the engine, by this key
            pool = self.pool_model(model.base_model, model.lora, model.seed)
            self.samplers[sampler_id].pool = pool

        def work(handle: ModelHandle) -> dict:
            if self.engine_samples:
                data = handle.call("state_bytes", False)["adapter.safetensors"]
                pool.worker.submit(
                    lambda: live(pool).call("add_snapshot_bytes", key, data)
                ).result()
            else:
                handle.call("snapshot", key)
                snap = {"op": "snap", "model_id": model.model_id, "key": key}
                self.registry.calls.note(snap)  # the model's history (``journal.py``)
            return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}

        return self.registry.run_on(model, "save_weights_for_sampler", work), model.model_id

    def create(self, namespace: str | None, req: Any) -> str:
        """A ``CreateSamplingSessionRequest``: a sampler of a saved path or of a base model."""
        session = self.registry.session(namespace, req.session_id)
        if req.model_path:
            return self.from_path(namespace, session, req.model_path)
        if not req.base_model:
            raise ServiceError(400, "create_sampling_session needs model_path or base_model")
        self.registry.base_uri(req.base_model)
        sampler = Sampler(
            f"{session.session_id}:sample:{secrets.token_hex(4)}",
            namespace,
            req.base_model,
            None,
            None,
            None,
        )
        return self.add(namespace, session, sampler)

    def sample(
        self,
        namespace: str | None,
        sampler_id: Any,
        prompt: list[int],
        n: int,
        params: SampleParams,
        scoring: PromptScoring,
        images: list[ImageInput] | None = None,
    ) -> str:
        """Queue ``n`` samples of ``prompt`` on the sampler's model, with what ``scoring``
        asks of the prompt; the future's id (the caller's, also when the model is a shared pool
        model)."""
        sampler = self.sampler(namespace, sampler_id)
        beyond = scoring.topk or scoring.targets is not None or scoring.last_n
        if self.engine_samples and images:
            raise ServiceError(400, "image prompts are served by the hf sampler, not by vllm")
        if self.engine_samples and beyond:
            raise ServiceError(
                400,
                "topk_prompt_logprobs, target_prompt_logprobs and prompt_logprobs_last_n are "
                "served by the hf sampler, not by --sampler-engine vllm",
            )
        prompt_logprobs = scoring if beyond else scoring.logprobs
        target = self.target(sampler)
        if target.handle is not None:  # else checked on the model's worker, once it is up
            check_fits(prompt, params, target.handle.info)
        weights = sampler.weights

        extra = [images] if images else []  # (a text prompt's call is as it always was)

        def work(handle: ModelHandle) -> bytes:  # the model checks prompt and context again
            return write_sample_response(
                handle.call("sample", prompt, n, params, weights, prompt_logprobs, *extra)
            )

        return self.registry.run_on(target, "sample", work, namespace=namespace)

    def join(self, namespace: str | None, sampler_id: Any) -> int:
        """One more client of a sampler; how many it has."""
        sampler = self.sampler(namespace, sampler_id)
        with self.lock:
            sampler.clients += 1
            return sampler.clients
