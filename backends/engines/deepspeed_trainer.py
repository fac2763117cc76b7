"""A trainer worker on DeepSpeed ZeRO-2/3 with the same verbs as ``TorchTrainer``.

Batching, log-probs, the policy losses and the KL reference are ``TorchTrainer``'s; what changes
is who owns the optimiser state and the gradients: the DeepSpeed engine (ZeRO partitions them
across ranks; ZeRO-3 the parameters too). It runs wherever DeepSpeed runs: GPUs with NCCL, or
CPU with gloo in one process (CI). ``deepspeed`` is imported when a worker starts, so the
package is only needed where this backend is selected (``resources.trainer_backend``).

Checkpoints are DeepSpeed's own (``engine.save_checkpoint``: weights, partitioned optimiser
state), packed into one file and committed with the same protocol as ``TorchTrainer``'s.
"""

from __future__ import annotations

import contextlib
import os
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from flowrl.backends.engines.hf_model import trainable_state
from flowrl.backends.engines.torch_trainer import TorchTrainer
from flowrl.backends.types import WorkerSpec
from flowrl.infra.servers import free_port

CHECKPOINT_TAG = "flowrl"


def init_single_process_group(backend: str) -> None:
    """Join (or, alone, create) the process group DeepSpeed needs. Under ``torchrun`` or a Ray
    launcher the rank variables are already set; a lone worker becomes rank 0 of 1."""
    import deepspeed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if backend == "gloo":
        # DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce op (a C++ build of a
        # minute or more) that only speeds up several ranks on one host: skip it on CPU.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend=backend)


def deepspeed_config(spec: WorkerSpec, zero_stage: int) -> dict[str, Any]:
    """The engine config: float32 weights and optimiser (with ``spec.dtype`` bfloat16 the
    forward pass autocasts, as in ``TorchTrainer``: ``backends.models.precision``), one micro-batch
    per ``forward_backward``, gradient clipping at ``spec.max_grad_norm``."""
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": spec.max_grad_norm,
        "zero_optimization": {"stage": zero_stage},
        "zero_allow_untested_optimizer": True,  # torch AdamW: no compiled ops needed
        "steps_per_print": 2**31 - 1,
    }


class DeepSpeedTrainer(TorchTrainer):
    """ZeRO-2 trainer (``trainer_backend: deepspeed``); ``DeepSpeedZero3Trainer`` for ZeRO-3.

    Call ``forward_backward`` once per ``optim_step`` (DeepSpeed reduces the gradients of each
    backward into its partitions).
    """

    zero_stage = 2
    restartable = False
    """A DeepSpeed engine holds its process's distributed state: a new job's trainer is a new
    process."""
    backward_without_rows = False
    """The engine's gradient hooks (ZeRO-3: its parameters gathered) expect the model's own
    forward pass: a batch of advantage-0 rows runs them all."""
    passes_on_cpu = False
    """One pass per update: the engine takes one backward per optimiser step."""

    def __init__(self, spec: WorkerSpec):
        import deepspeed

        super().__init__(spec)
        init_single_process_group("nccl" if self.device.type == "cuda" else "gloo")
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=self.model,
            optimizer=self.optimizer,
            config=deepspeed_config(spec, self.zero_stage),
        )

    def _backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def optim_step(self) -> dict[str, float]:
        """Clip, step and zero the gradients (all inside the engine); bump the version."""
        self.engine.step()
        self.version += 1
        grad_norm = self.engine.get_global_grad_norm()
        return {"grad_norm": float(grad_norm or 0.0), "weights_version": self.version}

    @contextlib.contextmanager
    def _full_parameters(self) -> Iterator[None]:
        """Inside: every parameter is whole on this rank (a no-op below ZeRO-3)."""
        yield

    def get_weights(self) -> tuple[dict[str, torch.Tensor], int]:
        with self._full_parameters():
            return trainable_state(self.model, self.spec.lora.enabled), self.version

    def save_state(self, storage_url: str, prefix: str, step: int, meta: dict[str, Any]) -> str:
        """Commit ``engine.save_checkpoint`` (weights + partitioned optimiser) plus the RNG."""
        from flowrl.infra.storage import Storage, commit_checkpoint

        meta = {**meta, "weights_version": self.version, "lora": self.spec.lora.enabled}
        meta |= {"zero_stage": self.zero_stage}
        with tempfile.TemporaryDirectory(prefix="flowrl-checkpoint-") as tmp:
            self.engine.save_checkpoint(tmp, tag=CHECKPOINT_TAG)
            files = {"deepspeed.tar": Path(tmp, "deepspeed.tar"), "rng.pt": Path(tmp, "rng.pt")}
            with tarfile.open(files["deepspeed.tar"], mode="w") as tar:
                tar.add(os.path.join(tmp, CHECKPOINT_TAG), arcname=CHECKPOINT_TAG)
            torch.save({"torch": torch.get_rng_state()}, files["rng.pt"])
            return commit_checkpoint(Storage(storage_url), prefix, step, files, meta)

    def load_state(self, storage_url: str, prefix: str) -> dict[str, Any] | None:
        from flowrl.infra.storage import Storage, load_latest_checkpoint

        with tempfile.TemporaryDirectory(prefix="flowrl-checkpoint-") as tmp:
            latest = load_latest_checkpoint(Storage(storage_url), prefix, into=Path(tmp, "files"))
            if latest is None:
                return None
            step, files, meta = latest
            with tarfile.open(files["deepspeed.tar"], mode="r") as tar:
                tar.extractall(tmp, filter="data")
            self.engine.load_checkpoint(tmp, tag=CHECKPOINT_TAG)
            torch.set_rng_state(torch.load(files["rng.pt"], weights_only=True)["torch"])
        self.version = int(meta.get("weights_version", step))
        return {**meta, "step": step}

    def export_pretrained(self, storage_url: str, rel: str) -> str:
        with self._full_parameters():
            return super().export_pretrained(storage_url, rel)


class DeepSpeedZero3Trainer(DeepSpeedTrainer):
    """ZeRO-3: parameters are partitioned too, and gathered whole to read or export them."""

    zero_stage = 3

    @contextlib.contextmanager
    def _full_parameters(self) -> Iterator[None]:
        import deepspeed

        params = list(self.model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            yield
