"""The SFT stages as Prefect tasks: data split, a run of optimiser steps, exact-match eval,
register. Like the RL stages they call the policy's workers and pass small records."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from backends.actors import PolicyRef, sampler, sync_weights, trainer
from environments.data import StaticSource, load_rows
from infra.sft_config import SFTJobConfig
from infra.storage import Storage
from tasks.common import chat_format
from tasks.model import sft_datum
from tasks.types import JobContext

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
    train_rows = _check_rows(load_rows(cfg.data.train), cfg.data.train)
    if cfg.data.eval is not None:
        eval_rows = _check_rows(load_rows(cfg.data.eval), cfg.data.eval)
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
    chat, worker = chat_format(model_uri, ctx.cache_dir), trainer(policy)
    losses = []
    for _ in range(num_steps):
        batch = [
            sft_datum(chat, row["messages"]) for row in source.next_batch(cfg.train.batch_size)
        ]
        losses.append(worker.forward_backward(batch, "cross_entropy")["loss"])
        stats = worker.optim_step()
    sync_weights(policy)
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
) -> dict[str, float]:
    """Greedy answer to each held-out conversation's last assistant turn; exact match rate
    (after stripping whitespace)."""
    start = time.perf_counter()
    chat = chat_format(model_uri, ctx.cache_dir)
    rows = Storage(ctx.storage_url).read_json(data.eval)
    pairs = [_prompt_and_answer(row["messages"]) for row in rows]
    hits = 0
    for i in range(0, len(pairs), EVAL_BATCH):
        chunk = pairs[i : i + EVAL_BATCH]
        prompts = [chat.encode_prompt(messages) for messages, _ in chunk]
        results = sampler(policy).sample(prompts, cfg.train.max_new_tokens, 0.0, cfg.seed)
        for (_, answer), result in zip(chunk, results, strict=True):
            hits += chat.decode(result.tokens).strip() == answer.strip()
    return {
        "eval/exact_match": hits / max(len(pairs), 1),
        "eval/seconds": time.perf_counter() - start,
    }
