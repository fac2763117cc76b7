"""Model stages: prepare the base model, SFT warm-up (cached in storage), register the policy."""

from __future__ import annotations

import tempfile
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from backends.actors import PolicyRef, start_policy, stop_policy, sync_weights, trainer
from backends.models import build_tiny_model, pin_model_uri
from backends.types import Datum, WorkerSpec
from infra import tracking
from infra.config import RLJobConfig
from infra.storage import Storage
from tasks.common import chat_format, evaluate_policy, stable_hash
from tasks.rl import loop_limits
from tasks.types import JobContext

DONE_MARKER = "DONE.json"


@task(name="prepare-model", cache_policy=NO_CACHE)
def prepare_model(cfg: RLJobConfig, ctx: JobContext) -> str:
    """The base model's URI: ``model.source`` (a registry alias pinned to the version it names
    now), or a tiny model built once into storage."""
    if cfg.model.source != "tiny":
        return pin_model_uri(cfg.model.source)
    storage = Storage(ctx.storage_url)
    spec = cfg.model.tiny
    # A text model's key leaves the (disabled) vision section out: the same key as before it.
    shape = spec.model_dump(exclude=None if spec.vision.enabled else {"vision"})
    rel = f"models/tiny-{stable_hash(shape)}"
    if not storage.exists(f"{rel}/{DONE_MARKER}"):
        with tempfile.TemporaryDirectory() as tmp:
            build_tiny_model(spec, tmp)
            storage.put_dir(tmp, rel)
        storage.write_json(f"{rel}/{DONE_MARKER}", shape)
    return storage.uri(rel)


def sft_datum(chat: Any, messages: list[dict[str, Any]]) -> Datum:
    """A conversation as the agent loop would have produced it: every assistant message is
    trained on (mask 1) exactly as the sampler emits it (content + stop token); the opening
    messages and every later user/tool message are injected (mask 0) with ``encode_turn``.

    Images: a user/tool message's content may be parts where an image part carries its
    encoded bytes, ``{"type": "image", "image": b"..."}``; they become ``Datum.images`` in
    order and the part is rendered (as its image tokens) exactly as the agent loop renders it."""
    messages, images = _split_images(messages)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    tokens = chat.encode_prompt(messages[:first])
    mask = [0] * len(tokens)
    for message in messages[first:]:
        if message["role"] == "assistant":
            piece = chat.tokenizer.encode(message["content"], add_special_tokens=False)
            piece, flag = piece + chat.stop_token_ids[:1], 1
        else:
            piece, flag = chat.encode_turn(message), 0
        tokens, mask = tokens + piece, mask + [flag] * len(piece)
    return Datum(tokens, mask, images=images)


def _split_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[bytes]]:
    """The messages with image parts reduced to ``{"type": "image"}``, and the images' bytes."""
    images: list[bytes] = []
    out = []
    for message in messages:
        if isinstance(message.get("content"), list):
            parts = []
            for part in message["content"]:
                if part.get("type") == "image":
                    images.append(bytes(part["image"]))
                    part = {"type": "image"}
                parts.append(part)
            message = {**message, "content": parts}
        out.append(message)
    return out, images


@task(name="warmup", cache_policy=NO_CACHE)
def warmup(cfg: RLJobConfig, ctx: JobContext, base_uri: str) -> dict[str, Any]:
    """SFT the base model until held-out accuracy reaches the target; cached by content hash.

    Returns ``{"model_uri", "accuracy", "steps", "cached"}``. A second job with the same
    base model, environment and warm-up settings reuses the stored result.
    """
    if not cfg.warmup.enabled:
        return {"model_uri": base_uri, "accuracy": None, "steps": 0, "cached": False}
    storage = Storage(ctx.storage_url)
    key = stable_hash(base_uri, cfg.env.model_dump(), cfg.warmup.model_dump(), cfg.seed)
    rel = f"cache/warmup-{key}"
    if storage.exists(f"{rel}/{DONE_MARKER}"):
        return {**storage.read_json(f"{rel}/{DONE_MARKER}"), "cached": True}
    spec = WorkerSpec(
        model_uri=base_uri,
        cache_dir=ctx.cache_dir,
        learning_rate=cfg.warmup.learning_rate,
        seed=cfg.seed,
        torch_threads=cfg.resources.torch_threads,
    )
    policy = start_policy(f"{ctx.run_name}-warmup", spec, local=False)
    try:
        result = _sft_until(cfg, ctx, base_uri, policy)
        trainer(policy).export_pretrained(ctx.storage_url, rel)
    finally:
        stop_policy(policy)
    result = {**result, "model_uri": storage.uri(rel)}
    storage.write_json(f"{rel}/{DONE_MARKER}", result)
    return {**result, "cached": False}


def _sft_until(cfg: RLJobConfig, ctx: JobContext, base_uri: str, policy: PolicyRef) -> dict:
    task_cfg = cfg.env.task()
    source = task_cfg.train_source()
    chat = chat_format(base_uri, ctx.cache_dir)
    worker = trainer(policy)
    accuracy, step = 0.0, 0
    while step < cfg.warmup.max_steps:
        rows = source.next_batch(cfg.warmup.batch_size)
        data = [sft_datum(chat, task_cfg.sft_example(row)) for row in rows]
        worker.forward_backward(data, "cross_entropy")
        worker.optim_step()
        step += 1
        if step % cfg.warmup.eval_every == 0 or step == cfg.warmup.max_steps:
            sync_weights(policy)
            accuracy = evaluate_policy(task_cfg, policy, chat, loop_limits(cfg)).accuracy
            if accuracy >= cfg.warmup.target_accuracy:
                break
    return {"accuracy": accuracy, "steps": step}


@task(name="register", cache_policy=NO_CACHE)
def register(
    cfg: Any, ctx: JobContext, policy: PolicyRef, run_id: str, metrics: dict[str, float]
) -> str:
    """Export the policy as an HF folder (LoRA merged), log it to the MLflow run, register a
    new version of ``cfg.registered_model_name`` (any job config: RL, SFT, self-play)."""
    storage = Storage(ctx.storage_url)
    rel = f"{ctx.prefix}/policy"
    trainer(policy).export_pretrained(ctx.storage_url, rel)
    with tempfile.TemporaryDirectory() as tmp:
        storage.get_dir(rel, tmp)
        return tracking.register_policy(run_id, tmp, cfg.registered_model_name, metrics)
