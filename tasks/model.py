"""Model stages: prepare the base model, SFT warm-up (cached in storage), register the policy."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from flowrl.agent_loop.seeding import stable_hash
from flowrl.backends.models.chat import conversation_needs, probe
from flowrl.backends.models.mlflow_model import save_chat_model
from flowrl.backends.models.model_folder import model_positions
from flowrl.backends.models.model_uri import (
    CACHE_BOOKKEEPING,
    build_tiny_model_once,
    cached_tiny_model,
    pin_model_uri,
    resolve_model_uri,
    tiny_model_key,
    tiny_model_slot,
)
from flowrl.backends.models.tiny_model import TinyModelSpec, build_tiny_model
from flowrl.backends.policy.actors import PolicyRef, stop_policy, trainer
from flowrl.backends.policy.workers import run_on_ray
from flowrl.backends.types import WorkerSpec
from flowrl.environments import registry
from flowrl.environments.agent import AgentTask
from flowrl.environments.data import ROW_FORMATS, StaticSource
from flowrl.environments.plugin import play
from flowrl.environments.timeouts import TimedEnv
from flowrl.environments.types import NoDemonstration, TaskConfig
from flowrl.infra import tracking
from flowrl.infra.scheduler import gpu_slots
from flowrl.infra.storage import Storage
from flowrl.tasks.chat_formats import chat_format
from flowrl.tasks.episodes import evaluate_policy
from flowrl.tasks.schemas import JOB_KINDS, JobConfig, RLJobConfig, TrainingJobConfig
from flowrl.tasks.sft import chat_rows, sft_steps
from flowrl.tasks.types import JobContext, WarmupResult

DONE_MARKER = "DONE.json"
SHARED_WARMUP_SEED = 0
"""The warm-up seed of every tenant of a shared worker (``warmup``)."""


@task(name="prepare-model", cache_policy=NO_CACHE)
def prepare_model(cfg: JobConfig, ctx: JobContext) -> str:
    """The base model's URI: ``model.source`` (a registry alias pinned to the version it names
    now), or a tiny model built once into storage."""
    if cfg.model.source != "tiny":
        uri = pin_model_uri(cfg.model.source)
        chat = chat_format(uri, ctx.cache_dir, cfg.model)
        # The probe of what the job's environment sends, before any worker starts.
        env = getattr(cfg, "env", None)
        probe(chat, conversation_needs(env.task(cfg.seed)) if env is not None else None)
        _check_context(cfg, model_positions(resolve_model_uri(uri, ctx.cache_dir)))
        return uri
    _check_context(cfg, cfg.model.tiny.max_position_embeddings)
    storage = Storage(ctx.storage_url)
    spec = cfg.model.tiny
    # A text model's key leaves the (disabled) vision section out: the same key as before it.
    shape = spec.model_dump(exclude=None if spec.vision.enabled else {"vision"})
    key = tiny_model_key(spec)
    rel = f"models/tiny-{key}"
    if not storage.exists(f"{rel}/{DONE_MARKER}"):
        # Built once per machine into the model cache (every home on it may share the cache);
        # a cached build is only copied, and the flow process imports no torch either way.
        slot = tiny_model_slot(ctx.cache_dir, key)
        built = cached_tiny_model(slot)
        if built is not None:
            storage.put_dir(built, rel, exclude=CACHE_BOOKKEEPING)
        elif MODEL_CODE in sys.modules:  # a notebook's, a test's process: nothing to import
            _build_into_storage(spec, str(slot), ctx.storage_url, rel)
        else:
            run_on_ray(_build_into_storage, spec, str(slot), ctx.storage_url, rel)
        storage.write_json(f"{rel}/{DONE_MARKER}", shape)
    return storage.uri(rel)


MODEL_CODE = "transformers.models.llama.modeling_llama"
"""Loaded already, it makes building a tiny model here cheap: no Ray task is started for it."""


def _build_into_storage(spec: TinyModelSpec, slot: str, storage_url: str, rel: str) -> None:
    """In a Ray worker (or a process with the model code loaded): build into this node's
    model cache (a temporary folder if the cache cannot be written there), then copy into
    storage."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            folder = build_tiny_model_once(spec, Path(slot))
        except OSError:
            folder = Path(build_tiny_model(spec, tmp))
        Storage(storage_url).put_dir(folder, rel, exclude=CACHE_BOOKKEEPING)


def _check_context(cfg: JobConfig, positions: int | None) -> None:
    """``rollout.max_context_tokens`` must fit the model's positions."""
    rollout = getattr(cfg, "rollout", None)
    if rollout is not None and positions is not None and rollout.max_context_tokens > positions:
        raise ValueError(
            f"rollout.max_context_tokens={rollout.max_context_tokens} exceeds the model's "
            f"{positions} positions (model.source {cfg.model.source!r})"
        )


@task(name="warmup", cache_policy=NO_CACHE)
def warmup(
    cfg: RLJobConfig, ctx: JobContext, base_uri: str, keep_workers: bool = False
) -> WarmupResult:
    """SFT the base model until held-out accuracy reaches the target; cached by content hash.

    Its workers start with the job's resources and backends (``placement_for()``), inside the
    job's GPU slots. With ``keep_workers`` a warm-up that ran hands them back running
    (``WarmupResult.workers``), for the job to restart from the warmed model rather than start
    new processes; else they are stopped. A second job with the same base model, environment
    and warm-up settings reuses the stored result.

    A tenant of a shared worker (``resources.placement`` shared) warms up with seed
    ``SHARED_WARMUP_SEED`` whatever its own, on workers of its own that it never keeps: every
    tenant of the same base, environment and warm-up settings then starts RL from one warmed
    model, the base its shared worker holds once (the first pays for the warm-up, the others
    reuse it), and trains its own adapter on it from its own seed.
    """
    if cfg.resources.placement == "shared":
        own = cfg.resources.model_copy(update={"placement": "own"})
        cfg = cfg.model_copy(update={"seed": SHARED_WARMUP_SEED, "resources": own})
        with gpu_slots(own.gpus):  # the job holds none: its shared worker holds them
            return _warmup(cfg, ctx, base_uri, keep_workers=False)
    return _warmup(cfg, ctx, base_uri, keep_workers)


def _warmup(cfg: RLJobConfig, ctx: JobContext, base_uri: str, keep_workers: bool) -> WarmupResult:
    if not cfg.warmup.enabled:
        return WarmupResult(base_uri, accuracy=None, steps=0, cached=False)
    task_cfg = cfg.env.task(cfg.seed)
    if not cfg.warmup.data and not getattr(task_cfg, "has_demonstrations", True):
        why = (
            f"environment {cfg.env.name!r} has no demonstration() method and warmup.data is "
            "unset: RL starts from the base model"
        )
        return WarmupResult(base_uri, accuracy=None, steps=0, cached=False, skipped=why)
    storage = Storage(ctx.storage_url)
    # Where episodes run (mode, service, actors, deadline) does not change what warm-up learns,
    # nor who plays them: an agent is warmed up on its task's demonstrations, as the task is.
    env = cfg.env.model_dump(exclude={"mode", "service_url", "ray_actors", "step_timeout_s"})
    if isinstance(task_cfg, AgentTask):
        env |= {"name": task_cfg.task, "params": task_cfg.task_params}
    code = _source_sha256(registry.load(env["name"]).target)  # an edited env re-runs warm-up
    key = stable_hash(base_uri, env, cfg.warmup.model_dump(), cfg.seed, code)
    rel = f"{ctx.cache_prefix}/warmup-{key}"
    if storage.exists(f"{rel}/{DONE_MARKER}"):
        done = storage.read_json(f"{rel}/{DONE_MARKER}")
        return WarmupResult(done["model_uri"], done["accuracy"], done["steps"], cached=True)
    spec = WorkerSpec(
        model_uri=base_uri,
        cache_dir=ctx.cache_dir,
        learning_rate=cfg.warmup.learning_rate,
        seed=cfg.seed,
    )
    policy = cfg.placement_for().start_policy(f"{ctx.run_name}-warmup", spec)
    try:
        accuracy, steps = _sft_until(cfg, ctx, task_cfg, base_uri, policy)
        trainer(policy).export_pretrained(ctx.storage_url, rel)
        result = WarmupResult(storage.uri(rel), accuracy, steps, cached=False)
        storage.write_json(f"{rel}/{DONE_MARKER}", dataclasses.asdict(result))
    except BaseException:
        stop_policy(policy)
        raise
    if not keep_workers:
        stop_policy(policy)
        return result
    return dataclasses.replace(result, workers=policy)


def warmup_plan(cfg: RLJobConfig) -> str:
    """What the warm-up is about to do, in words (the start of its log phase)."""
    if not cfg.warmup.enabled:
        return "disabled (warmup.enabled is false)"
    source = "warmup.data" if cfg.warmup.data else "the environment's demonstrations"
    return (
        f"SFT on {source} until held-out accuracy {cfg.warmup.target_accuracy:.2f}, at most "
        f"{cfg.warmup.max_steps} steps (an earlier job's identical warm-up is reused)"
    )


def describe_warmup(result: WarmupResult) -> str:
    """How a warm-up ended, in words (not the result's repr, which holds the workers' refs)."""
    if result.skipped:
        return f"skipped: {result.skipped}"
    if result.accuracy is None:
        return "not run: RL starts from the base model"
    how = "reused an earlier job's warm-up" if result.cached else "done"
    return f"{how}: held-out accuracy {result.accuracy:.3f} after {result.steps} SFT steps"


def _sft_until(
    cfg: RLJobConfig, ctx: JobContext, task_cfg: TaskConfig, base_uri: str, policy: PolicyRef
) -> tuple[float, int]:
    """SFT steps on demonstrations (``warmup.data``, else the environment's own),
    ``warmup.eval_every`` at a time, until held-out accuracy reaches the target or
    ``warmup.max_steps`` are done."""
    next_batch = _demonstrations(cfg, task_cfg)
    chat = chat_format(base_uri, ctx.cache_dir, cfg.model)
    greedy = cfg.rollout.limits(greedy=True)

    def timed(_episode_id: str) -> TimedEnv:  # in-process, with the job's deadline per call
        return TimedEnv(task_cfg.make_env(), cfg.env.step_timeout_s)

    accuracy, step = 0.0, 0
    while step < cfg.warmup.max_steps:
        n = min(cfg.warmup.eval_every, cfg.warmup.max_steps - step)
        sft_steps(policy, chat, (next_batch(cfg.warmup.batch_size) for _ in range(n)))
        step += n
        result = evaluate_policy(task_cfg, policy, chat, greedy, timed, cfg.env.success)
        accuracy = result.accuracy
        if accuracy >= cfg.warmup.target_accuracy:
            break
    return accuracy, step


def _demonstrations(cfg: RLJobConfig, task_cfg: TaskConfig) -> Callable[[int], list[list]]:
    """``next_batch(n)``: n demonstration conversations, from the ``warmup.data`` file (rows
    ``{"messages": [...]}``, reshuffled each epoch) or from the environment (``sft_example``
    of its next training rows)."""
    if cfg.warmup.data:
        source = StaticSource(chat_rows(cfg.warmup.data), seed=cfg.seed)
        return lambda n: [row["messages"] for row in source.next_batch(n)]
    rows = task_cfg.train_source()

    def next_batch(n: int) -> list[list]:
        examples: list[list] = []
        draws = 4 * n + 16  # rows without a demonstration are skipped, a bounded few
        for _ in range(draws):
            try:
                examples.append(task_cfg.sft_example(rows.next_batch(1)[0]))
            except NoDemonstration:
                continue
            if len(examples) == n:
                return examples
        raise RuntimeError(
            f"environment {cfg.env.name!r}: too few training rows have a demonstration "
            f"({len(examples)} of {draws} drawn); set warmup.data or turn warm-up off"
        )

    return next_batch


@task(name="register", cache_policy=NO_CACHE)
def register(
    cfg: TrainingJobConfig,
    ctx: JobContext,
    policy: PolicyRef,
    run_id: str,
    metrics: dict[str, float],
    base_uri: str,
) -> str:
    """Register the policy as a new version of ``cfg.registered_model_name`` in the job's
    namespace (any training job: RL, SFT, self-play): an MLflow Model (pyfunc over the HF
    folder, LoRA merged) with a chat signature, the job's metrics, and its lineage (base model,
    environment code, data files, config). The HF folder is also the run's ``policy``
    artifact."""
    storage = Storage(ctx.storage_url)
    rel = f"{ctx.prefix}/policy"
    trainer(policy).export_pretrained(ctx.storage_url, rel)
    lineage = job_lineage(cfg, base_uri)
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, model_dir = f"{tmp}/hf", f"{tmp}/mlflow-model"
        storage.get_dir(rel, hf_dir)
        save_chat_model(hf_dir, model_dir, _example_messages(cfg))
        return tracking.register_policy(
            run_id, hf_dir, model_dir, cfg.registered_model_name(ctx.namespace), metrics, lineage
        )


def job_lineage(cfg: TrainingJobConfig, base_uri: str) -> tracking.Lineage:
    """Where a job's model comes from: its base model, environment (with a hash of its code)
    and the data files its config names (with their content hashes)."""
    kind = next(k for k, schema in JOB_KINDS.items() if type(cfg) is schema)
    config = cfg.model_dump(mode="json")
    lineage = tracking.Lineage(job=cfg.name, kind=kind, base_model=base_uri, config=config)
    env = getattr(cfg, "env", None)
    files: list[tuple[str, str]] = []
    if env is not None:
        lineage.environment = env.name
        target = registry.load(env.name).target
        agent = isinstance(target, type) and issubclass(target, AgentTask)
        lineage.environment_code = _source_sha256(target.agent if agent else target)
        files += [("train", v) for v in env.params.values() if _is_data_file(v)]
    for data in (getattr(env, "data", None), getattr(cfg, "data", None)):  # env's rows, SFT's
        if data is not None:
            files += [(c, uri) for c, uri in (("train", data.train), ("eval", data.eval)) if uri]
    lineage.data = [tracking.DataFile(uri, _file_sha256(uri), c) for c, uri in files]
    return lineage


def _is_data_file(value: object) -> bool:
    return isinstance(value, str) and value.split("?", 1)[0].lower().endswith(ROW_FORMATS)


def _source_sha256(cls: type) -> str:
    source = inspect.getsourcefile(cls)
    return hashlib.sha256(Path(source).read_bytes()).hexdigest() if source else ""


def _file_sha256(uri: str) -> str:
    import fsspec

    digest = hashlib.sha256()
    with fsspec.open(uri, "rb", skip_instance_cache=True) as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _example_messages(cfg: TrainingJobConfig) -> list[dict[str, str]]:
    """The model's input example: a held-out prompt of the job's own environment."""
    env = getattr(cfg, "env", None)
    if env is not None:
        task_cfg = env.task(cfg.seed)
        rows = task_cfg.eval_set()
        if rows:
            if getattr(task_cfg, "has_demonstrations", True):
                conversation = task_cfg.sft_example(rows[0])
            else:  # a user's class without demonstration(): its opening messages
                conversation = play(task_cfg.make_env(), rows[0], [])
            prompt = [m for m in conversation if m.get("role") != "assistant"][:2]
            if prompt and all(isinstance(m.get("content"), str) for m in prompt):
                return [{"role": m["role"], "content": m["content"]} for m in prompt]
    return [{"role": "user", "content": "Hello"}]
