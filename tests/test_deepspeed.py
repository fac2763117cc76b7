"""The DeepSpeed trainer (ZeRO-2 and ZeRO-3, CPU + gloo, one process) behind the same verbs as
``TorchTrainer``: it learns, its weights sync into the HF sampler, its checkpoints round-trip."""

from __future__ import annotations

from pathlib import Path

import deepspeed  # noqa: E402,F401  (dev extra: a missing install fails, never skips)
import pytest
import torch

from flowrl.backends.engines.deepspeed_trainer import DeepSpeedTrainer, DeepSpeedZero3Trainer  # noqa: E402
from flowrl.backends.engines.hf_sampler import HFSampler  # noqa: E402
from flowrl.backends.models.tiny_model import TinyModelSpec, build_tiny_model  # noqa: E402
from flowrl.backends.types import Datum, LoraSettings, WorkerSpec  # noqa: E402

torch.set_num_threads(1)
TARGET = [5, 9, 14, 7, 3, 11]  # any token ids: the model is asked to memorise this sequence


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    spec = TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    return build_tiny_model(spec, str(tmp_path_factory.mktemp("tiny-ds")))


def _target_logprob(worker) -> float:
    datum = Datum(TARGET, [0] + [1] * (len(TARGET) - 1))
    return sum(worker.compute_logprobs([datum])[0][1:])


def _train(worker, steps: int) -> list[float]:
    datum = Datum(TARGET, [0] + [1] * (len(TARGET) - 1))
    losses = []
    for _ in range(steps):
        losses.append(worker.forward_backward([datum], "cross_entropy")["loss"])
        worker.optim_step()
    return losses


@pytest.mark.parametrize(
    ("cls", "lora"),
    [(DeepSpeedTrainer, False), (DeepSpeedZero3Trainer, False), (DeepSpeedTrainer, True)],
    ids=["zero2", "zero3", "zero2-lora"],
)
def test_deepspeed_trains_syncs_and_round_trips_checkpoints(cls, lora, model_dir, tmp_path: Path):
    settings = LoraSettings(enabled=lora, r=4, alpha=8)
    spec = WorkerSpec(
        model_uri=model_dir,
        cache_dir=str(tmp_path / "cache"),
        learning_rate=1e-2,
        lora=settings,
        device="cpu",
    )
    worker = cls(spec)
    start = _target_logprob(worker)
    losses = _train(worker, 8)
    assert losses[-1] < losses[0]
    assert _target_logprob(worker) > start + 1.0  # the target became far likelier

    # weight sync: the HF sampler, given the DeepSpeed trainer's weights, agrees with it
    hf = HFSampler(spec)
    hf.set_weights(worker.get_weights())
    prompt = TARGET[:2]
    sample = hf.sample([prompt], max_new_tokens=4, temperature=1.0, seed=0)[0]
    datum = Datum(prompt + sample.tokens, [0] * 2 + [1] * len(sample.tokens))
    trainer_lp = worker.compute_logprobs([datum])[0][2:]
    assert trainer_lp == pytest.approx(sample.logprobs, abs=1e-4)

    # checkpoint: save, move on, load -> back to the saved weights and version
    storage = f"file://{tmp_path / 'store'}"
    worker.save_state(storage, "ckpt", step=8, meta={"note": "x"})
    saved_lp, saved_weights = _target_logprob(worker), worker.get_weights()[0]
    _train(worker, 3)
    assert _target_logprob(worker) != pytest.approx(saved_lp, abs=1e-6)
    meta = worker.load_state(storage, "ckpt")
    assert meta["step"] == 8 and meta["note"] == "x" and meta["zero_stage"] == cls.zero_stage
    assert worker.version == 8
    assert _target_logprob(worker) == pytest.approx(saved_lp, abs=1e-5)
    loaded = worker.get_weights()[0]
    assert all(torch.equal(loaded[k], saved_weights[k]) for k in saved_weights)
    # and it keeps training from there (the engine's optimiser state came back too)
    more = _train(worker, 2)
    assert more[1] < more[0]

    # A policy-loss batch: a row of advantage 0 is left out of the passes; a batch of only such
    # rows runs them all through the engine (its hooks expect a forward pass), and steps.
    alike = [Datum(TARGET, [0] + [1] * 5, 0.0), Datum(TARGET[:4], [0, 1, 1, 1], 0.0)]
    assert worker.forward_backward(alike, "ppo_clip")["zero_advantage_rows"] == 0.0
    assert worker.optim_step()["weights_version"] == 11
    mixed = [alike[0], Datum(TARGET, [0] + [1] * 5, 1.0)]
    assert worker.forward_backward(mixed, "ppo_clip")["zero_advantage_rows"] == 0.5
    assert worker.optim_step()["weights_version"] == 12
