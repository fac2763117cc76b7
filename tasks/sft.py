"""The SFT stages as Prefect tasks: data split, a run of optimiser steps, exact-match eval,
register. Like the RL stages they call the policy's workers and pass small records."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from flowrl.backends.policy.actors import PolicyRef, sampler, sync_weights, trainer
from flowrl.backends.types import Datum
from flowrl.environments.data import StaticSource, load_rows
from flowrl.infra.storage import Storage
from flowrl.tasks.chat_formats import chat_format
from flowrl.tasks.schemas import SFTJobConfig
from flowrl.tasks.types import ExactMatch, JobContext

EVAL_BATCH = 64
"""Conversations per sampler call at evaluation."""


@dataclass(frozen=True)
class SFTData:
    """Where the job's train and eval conversations are (storage-relative JSON)."""

    train: str
    eval: str
    num_train: int
    num_eval: int


@dataclass(frozen=True)
class SFTChunk:
    """What a run of steps produced: per-step losses and the data cursor after it."""

    losses: list[float]
    cursor: dict[str, Any]
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)


def sft_datum(chat: Any, messages: list[dict[str, Any]]) -> Datum:
    """A conversation as the agent loop would have produced it: every assistant message is
    trained on (mask 1) exactly as the sampler emits it (content + end-of-turn token); the opening
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
            piece, flag = chat.encode_reply(message["content"]), 1
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


def sft_steps(
    policy: PolicyRef, chat: Any, batches: Iterable[list[list[dict[str, Any]]]]
) -> tuple[list[float], dict[str, float]]:
    """One optimiser step per batch of conversations (loss on assistant tokens only), then a
    weight sync to the sampler. The one SFT loop: warm-up and the SFT job both run it.
    Returns each step's loss and the last step's optimiser stats."""
    worker, losses, stats = trainer(policy), [], {}
    for conversations in batches:
        data = [sft_datum(chat, messages) for messages in conversations]
        losses.append(worker.forward_backward(data, "cross_entropy")["loss"])
        stats = worker.optim_step()
    sync_weights(policy)
    return losses, stats


def chat_rows(uri: str) -> list[dict[str, Any]]:
    """The rows ``{"messages": [...]}`` of a chat-format file (JSONL, JSON or parquet; local or
    ``s3://``). Raises ``ValueError`` naming the first row without an assistant message."""
    return _check_rows(load_rows(uri), uri)


def _check_rows(rows: list[dict[str, Any]], uri: str) -> list[dict[str, Any]]:
    for n, row in enumerate(rows):
        messages = row.get("messages")
        if not isinstance(messages, list) or not any(
            isinstance(m, dict) and m.get("role") == "assistant" for m in messages
        ):
            raise ValueError(f"{uri!r}: row {n} needs 'messages' with an assistant message")
    return [{"messages": row["messages"]} for row in rows]


@task(name="sft-data", cache_policy=NO_CACHE)
def prepare_data(cfg: SFTJobConfig, ctx: JobContext) -> SFTData:
    """Read the chat rows (local or ``s3://``), hold out the eval rows, store both as JSON."""
    storage = Storage(ctx.storage_url)
    train_rows = chat_rows(cfg.data.train)
    if cfg.data.eval is not None:
        eval_rows = chat_rows(cfg.data.eval)
    else:
        if len(train_rows) <= cfg.data.eval_size:
            raise ValueError(f"data.eval_size {cfg.data.eval_size} leaves no training rows")
        random.Random(cfg.seed).shuffle(train_rows)
        eval_rows, train_rows = train_rows[: cfg.data.eval_size], train_rows[cfg.data.eval_size :]
    rels = (f"{ctx.prefix}/data/train.json", f"{ctx.prefix}/data/eval.json")
    for rel, rows in zip(rels, (train_rows, eval_rows), strict=True):
        storage.write_json(rel, rows)
    return SFTData(rels[0], rels[1], len(train_rows), len(eval_rows))


@task(name="sft-steps", cache_policy=NO_CACHE)
def train_steps(
    cfg: SFTJobConfig,
    ctx: JobContext,
    model_uri: str,
    policy: PolicyRef,
    data: SFTData,
    num_steps: int,
    cursor: dict[str, Any] | None,
) -> SFTChunk:
    """``num_steps`` SFT steps (loss on assistant tokens only), then weight sync to the sampler."""
    start = time.perf_counter()
    source = StaticSource(Storage(ctx.storage_url).read_json(data.train), seed=cfg.seed)
    if cursor:
        source.load_state(cursor)
    batches = (
        [row["messages"] for row in source.next_batch(cfg.train.batch_size)]
        for _ in range(num_steps)
    )
    losses, stats = sft_steps(
        policy,
        chat_format(model_uri, ctx.cache_dir, cfg.model),
        batches,
    )
    seconds = time.perf_counter() - start
    metrics = {"train/grad_norm": stats["grad_norm"], "time/steps_per_s": num_steps / seconds}
    return SFTChunk(losses, source.state(), seconds, metrics)


def _prompt_and_answer(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """Everything before the last assistant message, and that message's text."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last], str(messages[last]["content"])


@task(name="sft-eval", cache_policy=NO_CACHE)
def evaluate_exact_match(
    cfg: SFTJobConfig, ctx: JobContext, model_uri: str, policy: PolicyRef, data: SFTData
) -> ExactMatch:
    """Greedy answer to each held-out conversation's last assistant turn; exact match rate
    (after stripping whitespace)."""
    start = time.perf_counter()
    chat = chat_format(model_uri, ctx.cache_dir, cfg.model)
    rows = Storage(ctx.storage_url).read_json(data.eval)
    pairs = [_prompt_and_answer(row["messages"]) for row in rows]
    hits = 0
    for i in range(0, len(pairs), EVAL_BATCH):
        chunk = pairs[i : i + EVAL_BATCH]
        prompts = [chat.encode_prompt(messages) for messages, _ in chunk]
        results = sampler(policy).sample(prompts, cfg.train.max_new_tokens, 0.0, cfg.seed)
        for (_, answer), result in zip(chunk, results, strict=True):
            hits += chat.decode(result.tokens).strip() == answer.strip()
    return ExactMatch(hits / max(len(pairs), 1), time.perf_counter() - start)
