"""Model stages: prepare the base model, SFT warm-up (cached in storage), register the policy."""

from __future__ import annotations

import dataclasses
import tempfile

from prefect import task
from prefect.cache_policies import NO_CACHE

from flowrl.backends.actors import PolicyRef, start_policy, stop_policy, trainer
from flowrl.backends.models import build_tiny_model, pin_model_uri
from flowrl.backends.types import WorkerSpec
from flowrl.infra import tracking
from flowrl.infra.settings import get_settings
from flowrl.infra.storage import Storage
from flowrl.tasks.common import chat_format, derived_seed, evaluate_policy, stable_hash
from flowrl.tasks.jobs import JobConfig, RLJobConfig, TrainingJobConfig
from flowrl.tasks.sft import sft_steps
from flowrl.tasks.types import JobContext, WarmupResult

DONE_MARKER = "DONE.json"


@task(name="prepare-model", cache_policy=NO_CACHE)
def prepare_model(cfg: JobConfig, ctx: JobContext) -> str:
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


@task(name="warmup", cache_policy=NO_CACHE)
def warmup(cfg: RLJobConfig, ctx: JobContext, base_uri: str) -> WarmupResult:
    """SFT the base model until held-out accuracy reaches the target; cached by content hash.

    Its workers start with the job's resources and backends (``resources.plan()``), inside the
    job's GPU slots. A second job with the same base model, environment and warm-up settings
    reuses the stored result.
    """
    if not cfg.warmup.enabled:
        return WarmupResult(base_uri, accuracy=None, steps=0, cached=False)
    storage = Storage(ctx.storage_url)
    key = stable_hash(base_uri, cfg.env.model_dump(), cfg.warmup.model_dump(), cfg.seed)
    rel = f"cache/warmup-{key}"
    if storage.exists(f"{rel}/{DONE_MARKER}"):
        done = storage.read_json(f"{rel}/{DONE_MARKER}")
        return WarmupResult(done["model_uri"], done["accuracy"], done["steps"], cached=True)
    spec = WorkerSpec(
        model_uri=base_uri,
        cache_dir=ctx.cache_dir,
        learning_rate=cfg.warmup.learning_rate,
        seed=cfg.seed,
    )
    policy = cfg.resources.plan().start(f"{ctx.run_name}-warmup", spec)
    try:
        accuracy, steps = _sft_until(cfg, ctx, base_uri, policy)
        trainer(policy).export_pretrained(ctx.storage_url, rel)
    finally:
        stop_policy(policy)
    result = WarmupResult(storage.uri(rel), accuracy, steps, cached=False)
    storage.write_json(f"{rel}/{DONE_MARKER}", dataclasses.asdict(result))
    return result


def _sft_until(
    cfg: RLJobConfig, ctx: JobContext, base_uri: str, policy: PolicyRef
) -> tuple[float, int]:
    """SFT steps on the environment's demonstrations, ``warmup.eval_every`` at a time, until
    held-out accuracy reaches the target or ``warmup.max_steps`` are done."""
    task_cfg = cfg.env.task()
    source = task_cfg.train_source()
    chat = chat_format(base_uri, ctx.cache_dir)
    greedy = cfg.rollout.limits(greedy=True)
    accuracy, step = 0.0, 0
    while step < cfg.warmup.max_steps:
        n = min(cfg.warmup.eval_every, cfg.warmup.max_steps - step)
        conversations = (
            [task_cfg.sft_example(row) for row in source.next_batch(cfg.warmup.batch_size)]
            for _ in range(n)
        )
        sft_steps(policy, chat, conversations)
        step += n
        accuracy = evaluate_policy(task_cfg, policy, chat, greedy).accuracy
        if accuracy >= cfg.warmup.target_accuracy:
            break
    return accuracy, step


@task(name="register", cache_policy=NO_CACHE)
def register(
    cfg: TrainingJobConfig,
    ctx: JobContext,
    policy: PolicyRef,
    run_id: str,
    metrics: dict[str, float],
) -> str:
    """Export the policy as an HF folder (LoRA merged), log it to the MLflow run, register a
    new version of ``cfg.registered_model_name`` (any training job: RL, SFT, self-play)."""
    storage = Storage(ctx.storage_url)
    rel = f"{ctx.prefix}/policy"
    trainer(policy).export_pretrained(ctx.storage_url, rel)
    with tempfile.TemporaryDirectory() as tmp:
        storage.get_dir(rel, tmp)
        return tracking.register_policy(run_id, tmp, cfg.registered_model_name, metrics)


@task(name="evaluate-model", cache_policy=NO_CACHE)
def evaluate_model(job: RLJobConfig, model_uri: str) -> float:
    """Greedy held-out accuracy of a registered model (in-process workers, the same eval code
    as training's): the retraining gate compares champion and challenger with it."""
    cache_dir = get_settings().model_cache_dir
    spec = WorkerSpec(model_uri=model_uri, cache_dir=cache_dir, seed=job.seed)
    policy = start_policy(f"eval-{derived_seed(model_uri)}", spec, local=True)
    try:
        chat = chat_format(model_uri, cache_dir)
        limits = job.rollout.limits(greedy=True)
        return evaluate_policy(job.env.task(), policy, chat, limits).accuracy
    finally:
        stop_policy(policy)
