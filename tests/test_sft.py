"""SFT on a chat dataset: loss on assistant tokens only lifts exact match; the flow end to end.

The data are arithmetic conversations written to JSONL from ``ArithmeticTask.sft_example``;
the held-out set is the environment's own held-out problems (never in the training stream).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from flowrl.backends.policy.actors import start_policy, stop_policy
from flowrl.backends.types import LoraSettings, WorkerSpec
from flowrl.environments.arithmetic import ArithmeticTask
from flowrl.infra.configfile import ConfigError
from flowrl.tasks.model import prepare_model
from flowrl.tasks.schemas import SFTJobConfig, load_job
from flowrl.tasks.sft import evaluate_exact_match, prepare_data, train_steps
from flowrl.tasks.types import JobContext

torch.set_num_threads(1)


def write_arithmetic_chat(folder: Path, num_train: int) -> tuple[str, str]:
    """``train.jsonl`` (the training stream's first problems) and ``eval.jsonl`` (held out)."""
    task = ArithmeticTask()
    train = [{"messages": task.sft_example(task.problem(i))} for i in range(num_train)]
    held_out = [{"messages": task.sft_example(row)} for row in task.eval_set()]
    paths = []
    for name, rows in (("train.jsonl", train), ("eval.jsonl", held_out)):
        path = folder / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(str(path))
    return paths[0], paths[1]


@pytest.fixture(scope="module")
def chat_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    # 2,000 rows (each of the ~800 training problems seen with the same few neighbours) learned
    # far slower than 40,000 (7.5% vs 15.5% after 200 steps, 2026-11-21): use the larger file.
    return write_arithmetic_chat(tmp_path_factory.mktemp("chat"), 40_000)


def test_sft_lifts_exact_match_to_80_percent_within_3_minutes(chat_files, tmp_path):
    train_uri, eval_uri = chat_files
    cfg = SFTJobConfig.model_validate(
        {
            "name": "sft-arith",
            "data": {"train": train_uri, "eval": eval_uri},
            # lr 1e-3, not 3e-3: at 3e-3 three of eight seeds stalled (exact match 0.05-0.31
            # after 800 steps) and so did seed 0 on AVX2 kernels (0.755); at 1e-3 all of nine
            # runs (eight seeds + AVX2) reached >= 0.88 by step 400 (2026-11-23, see the note
            # on issue 10).
            "train": {"batch_size": 64, "learning_rate": 1e-3},
        }
    )
    ctx = JobContext(cfg.name, str(tmp_path / "store"), str(tmp_path / "cache"), "sft-arith")
    start, cpu_start = time.perf_counter(), time.process_time()
    base_uri = prepare_model.fn(cfg, ctx)
    data = prepare_data.fn(cfg, ctx)
    assert (data.num_train, data.num_eval) == (40_000, 200)
    spec = WorkerSpec(
        model_uri=base_uri, cache_dir=ctx.cache_dir, learning_rate=cfg.train.learning_rate
    )
    policy = start_policy("test-sft", spec, local=True)
    try:
        before = evaluate_exact_match.fn(cfg, ctx, base_uri, policy, data).exact_match
        cursor, steps, accuracy, losses = None, 0, before, []
        while accuracy < 0.8 and steps < 800:
            chunk = train_steps.fn(cfg, ctx, base_uri, policy, data, 100, cursor)
            cursor, steps, losses = chunk.cursor, steps + 100, losses + chunk.losses
            accuracy = evaluate_exact_match.fn(cfg, ctx, base_uri, policy, data).exact_match
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    finally:
        stop_policy(policy)
    print(
        f"SFT exact match {before:.3f} -> {accuracy:.3f} in {steps} steps: {seconds:.1f} s wall, "
        f"{cpu_seconds:.1f} s CPU"
    )
    assert before < 0.05
    assert accuracy >= 0.8, (accuracy, steps)
    # The acceptance bound is 3 minutes on one core; on the shared test box the wall clock is
    # dominated by other processes, so the CPU time this process used is what is bounded.
    assert cpu_seconds < 180  # measured 16-36 s at the stop, <= 75 s for all 800 steps
    assert sum(losses[-10:]) < sum(losses[:10]) / 5  # the lowest ratio seen at the stop: 21


def test_loss_is_only_on_assistant_tokens(chat_files, tmp_path):
    """Changing the user's text changes no gradient-carrying token: the mask is 0 there."""
    from flowrl.tasks.chat_formats import chat_format
    from flowrl.tasks.sft import sft_datum

    cfg = SFTJobConfig.model_validate({"data": {"train": chat_files[0], "eval": chat_files[1]}})
    ctx = JobContext(cfg.name, str(tmp_path / "store"), str(tmp_path / "cache"), "mask")
    chat = chat_format(prepare_model.fn(cfg, ctx), ctx.cache_dir, cfg.model)
    datum = sft_datum(
        chat, [{"role": "user", "content": "12+7="}, {"role": "assistant", "content": "19"}]
    )
    trained = [t for t, m in zip(datum.tokens, datum.loss_mask, strict=True) if m]
    assert chat.decode(trained) == "19"
    assert trained[-1] == chat.stop_token_ids[0]


def test_sft_config_validates_at_the_edge(tmp_path):
    with pytest.raises(ConfigError, match="data.train"):
        load_job(None, ["data.train=rows.csv"], SFTJobConfig)
    with pytest.raises(ConfigError, match="data"):
        load_job(None, [], SFTJobConfig)
    cfg = load_job(
        None, ["data.train=s3://bucket/chat.parquet", "model.lora.enabled=true"], SFTJobConfig
    )
    assert cfg.model.lora == LoraSettings(enabled=True)
    for name, field in SFTJobConfig.model_fields.items():
        assert field.description, name


@pytest.mark.e2e
def test_sft_flow_trains_logs_and_registers(chat_files, prefect_api, flowrl_home):
    from flowrl.flows.sft import sft_train
    from flowrl.infra.tracking import client

    cfg = SFTJobConfig.model_validate(
        {
            "name": "sft-e2e",
            "data": {"train": chat_files[0], "eval_size": 100},
            "train": {"steps": 60, "eval_every": 30, "learning_rate": 3e-3},
        }
    )
    result = sft_train(cfg)
    assert result.model_uri == "models:/sft-e2e/1"
    run = client().get_run(result.mlflow_run_id)
    assert run.info.status == "FINISHED"
    losses = sorted(
        client().get_metric_history(result.mlflow_run_id, "train/loss"), key=lambda m: m.step
    )
    assert len(losses) == 60
    first, last = (sum(m.value for m in part) / 10 for part in (losses[:10], losses[-10:]))
    # full-parameter; LoRA (r 8, lr 1e-2) only went 3.90 -> 3.52 in 60 steps (measured)
    assert last < 0.8 * first, (first, last)
    assert len(client().get_metric_history(result.mlflow_run_id, "eval/exact_match")) == 3
    assert run.data.params["train.steps"] == "60"
