"""The self-play flow: the agents of a game (flowrl's Gomoku, or a user's game given as a
class) play each other; each has its own policy (sampler + trainer actors, optimiser,
checkpoint, registry entry) or one shared policy plays every side.

Phase barriers: every step runs ``duel-rollout`` (all games of both agents) to completion before
any ``update`` starts, and every agent's update (with its weight sync) completes before the
next rollout starts; Prefect's task-run records (start/end times) show it.

Every ``checkpoint_every`` steps every policy is checkpointed; resubmitting a job with the same
name resumes all of them from the last step they all committed (each step's openings and
sampling seeds are derived from the step, so the resumed steps play the same games).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefect import flow

from flowrl.backends.policy.actors import PolicyRef
from flowrl.flows.lifecycle import JobRun, StepClock, due, resumable, task_runner
from flowrl.flows.run_page import Column, job_run_name
from flowrl.tasks.model import describe_warmup, prepare_model, register, warmup, warmup_plan
from flowrl.tasks.rl import score, update
from flowrl.tasks.schemas import SelfPlayJobConfig
from flowrl.tasks.selfplay import (
    agent_context,
    checkpoint_policies,
    duel_rollout,
    head_to_head,
    restore_policies,
    trained_policies,
    versus_opponent,
)


@dataclass(frozen=True)
class SelfPlayResult:
    job: str
    model_uris: dict[str, str]
    """Registered version of each trained policy (``X``/``O``, or ``shared``)."""
    score_vs_heuristic: dict[str, float]
    """Final success share of each trained policy against the game's reference opponent
    (Gomoku: win or draw against the heuristic)."""
    mlflow_run_id: str
    steps: int
    """Self-play steps done in total (including those before a resume)."""
    resumed_from: int | None
    """The checkpoint step this run resumed from, or None for a fresh start."""


def columns(owners: tuple[str, ...]) -> tuple[Column, ...]:
    """The results table, step lines and curve of a self-play job: each trained policy's mean
    reward, its score against the game's reference opponent where evaluated, its update's
    loss, and the step's wall seconds."""

    def per_owner(name: str, metric: str, text: str, **kw: bool) -> list[Column]:
        return [Column(f"{o}/{name}", (metric.format(o),), f"{o} {text}", **kw) for o in owners]

    return (
        *per_owner("reward/mean", "{}/reward/mean", "reward {:.3f}", plot=True),
        *per_owner("score", "eval/{}/accuracy", "score {:.3f}", evaluated=True, plot=True),
        *per_owner("loss", "{}/train/loss", "loss {:.4f}"),
        Column("seconds", ("time/step_s",), "{:.2f} s/step"),
    )


@flow(
    name="self-play",
    task_runner=task_runner(),
    log_prints=True,
    flow_run_name=job_run_name(SelfPlayJobConfig),
)
@resumable
def self_play(config: SelfPlayJobConfig = SelfPlayJobConfig()) -> SelfPlayResult:  # noqa: B008
    owners = trained_policies(config)
    with JobRun(config, resume=True, columns=columns(owners)) as job:
        base_uri = prepare_model.submit(config, job.ctx).result()
        config = job.pick_sampler(base_uri)  # warm-up places workers with it
        with job.phase("warm-up", warmup_plan(config)) as phase:
            warm = warmup.submit(config, job.ctx, base_uri, keep_workers=True).result()
            phase.result = describe_warmup(warm)
        model_uri = warm.model_uri
        ctxs = {o: agent_context(job.ctx, o) for o in owners}
        # The first policy restarts the warm-up's workers (if it ran); the others start anew.
        adopt = dict.fromkeys(owners[:1], warm.workers)
        refs = {o: job.start_policy(model_uri, ctxs[o].run_name, adopt.get(o)) for o in owners}
        by_agent = {a: refs["shared" if config.shared_policy else a] for a in config.agents}
        start = restore_policies.submit(ctxs, refs).result()
        total, clock = config.schedule.steps, StepClock()
        plan = f"steps {start + 1}-{total}" if start < total else "no steps left"
        plan += f", resumed from the checkpoint at step {start}" if start else ", fresh start"
        with job.phase("self-play", f"{plan}; policies {', '.join(owners)}") as phase:
            for step in job.steps(start, total):
                # Barrier 1: the rollout phase (every game of every agent) ends before any update.
                duel = duel_rollout.submit(config, job.ctx, model_uri, by_agent, step).result()
                scored = {
                    o: score.submit(config, ctxs[o], refs[o], duel.batches[o]) for o in owners
                }
                updates = {o: update.submit(config, ctxs[o], refs[o], scored[o]) for o in owners}
                # Barrier 2: every update and weight sync ends before the next rollout.
                updated = {o: updates[o].result() for o in owners}
                job.log(duel.metrics | {"time/step_s": clock.lap()}, step + 1)
                for o in owners:
                    metrics = scored[o].result().metrics | updated[o].metrics
                    job.log({f"{o}/{k}": v for k, v in metrics.items()}, step + 1)
                if due(step, total, config.schedule.eval_every, at_end=True):
                    job.log(_evaluate(config, job, model_uri, refs, by_agent), step + 1)
                # An agent can have no game in a step (a TextArena game's first player
                # forfeiting by invalid moves before the second one moves): no outcome then.
                outcomes = {
                    f"{a}_outcome": duel.metrics[f"agent-{a}/outcome"]
                    for a in config.agents
                    if f"agent-{a}/outcome" in duel.metrics
                }
                job.advance(step + 1, **outcomes)
                if due(step, total, config.schedule.checkpoint_every, at_end=True):
                    job.flush_metrics(wait=False)  # on disk: the steps a checkpoint keeps keep them
                    checkpoint_policies.submit(config, ctxs, refs, step + 1).result()
            phase.result = f"done, {job.done_steps - start} steps"
        with job.phase("final evaluation", "each policy against the reference opponent") as ph:
            final = _evaluate(config, job, model_uri, refs, by_agent)
            scores = {o: final[f"eval/{o}/accuracy"] for o in owners}
            ph.result = "score " + ", ".join(f"{o} {v:.3f}" for o, v in scores.items())
        job.flush_metrics()  # the versions link the run's own points of their metrics
        uris = {}
        for o in owners:
            named = config.model_copy(update={"register_as": f"{config.model_name}-{o}"})
            metrics = {k: v for k, v in final.items() if k.startswith(f"eval/{o}/")}
            with job.phase(f"registration of {o}") as ph:
                submitted = register.submit(named, ctxs[o], refs[o], job.run_id, metrics, base_uri)
                uris[o] = submitted.result()
                ph.result = f"registered {uris[o]}"
        resumed = start or None
        result = SelfPlayResult(config.name, uris, scores, job.run_id, job.done_steps, resumed)
        job.finish(result)
    return result


def _evaluate(
    config: SelfPlayJobConfig,
    job: JobRun,
    model_uri: str,
    refs: dict[str, PolicyRef],
    by_agent: dict[str, PolicyRef],
) -> dict[str, float]:
    """Each trained policy against the game's reference opponent (on its own side, or every
    side for a shared policy), and the agents head to head."""
    futures = {
        o: versus_opponent.submit(
            config, job.ctx, model_uri, ref, config.agents if o == "shared" else (o,)
        )
        for o, ref in refs.items()
    }
    h2h = head_to_head.submit(config, job.ctx, model_uri, by_agent)
    metrics = h2h.result()
    for owner, future in futures.items():
        metrics |= future.result().metrics(f"eval/{owner}")
    return metrics
