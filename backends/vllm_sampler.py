"""A sampler worker on vLLM with the same verbs as ``HFSampler`` (GPU machines).

UNVERIFIED: written against vLLM's documented API (``LLM.generate``, ``SamplingParams``,
``LoRARequest``, ``LLM.collective_rpc`` with a ``worker_extension_cls``) but never run here,
because vLLM needs a GPU; ``benchmarks/gpu_check.py`` is the check to run on one. ``vllm`` is
imported when the worker starts, so nothing else needs it installed.

- ``sample``: one request per prompt as token ids; the sampled token's log-prob comes back with
  it (``logprobs=0``). ``logprobs_mode="processed_logprobs"`` makes those the log-probs of the
  temperature-scaled distribution, as ``HFSampler`` returns and the trainer recomputes.
- Weight sync, full parameters: the trainer's state dict is loaded in place in every vLLM
  worker (``model.load_weights`` through ``collective_rpc``); no restart, no file.
- Weight sync, LoRA: the adapter is written as a PEFT folder ``adapter-v<version>`` and used
  as ``LoRARequest(name, version, path)``: vLLM hot-loads a new adapter id without touching the
  base weights; older versions are removed from the engine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

import torch
from safetensors.torch import save_file

from flowrl.agent_loop.types import SampleResult
from flowrl.backends.chat import HFChatFormat
from flowrl.backends.model_folder import load_tokenizer
from flowrl.backends.model_uri import resolve_model_uri
from flowrl.backends.precision import compute_dtype
from flowrl.backends.types import WorkerSpec

WORKER_EXTENSION = "flowrl.backends.vllm_sampler.WeightSyncExtension"


class WeightSyncExtension:
    """Mixed into each vLLM worker (``worker_extension_cls``): loads weights in place."""

    def flowrl_load_weights(self, state: dict[str, torch.Tensor]) -> int:
        model = self.model_runner.model  # type: ignore[attr-defined]  # set by vLLM's Worker
        device = next(model.parameters()).device
        model.load_weights(weights=((k, v.to(device)) for k, v in state.items()))
        return len(state)


class VLLMSampler:
    """Batched sampling with vLLM, returning token ids and log-probs (``HFSampler``'s verbs)."""

    def __init__(self, spec: WorkerSpec, gpu_memory_utilization: float = 0.5):
        # The weight-sync RPC ships torch tensors to vLLM's worker processes, which vLLM's
        # multiprocessing executor only accepts with pickle-based serialisation allowed.
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        from vllm import LLM

        self.spec = spec
        self.model_path = resolve_model_uri(spec.model_uri, spec.cache_dir)
        self.tokenizer = load_tokenizer(self.model_path)
        self.stop_token_ids = HFChatFormat.from_folder(self.model_path).stop_token_ids
        lora: dict[str, Any] = {}
        if spec.lora.enabled:
            lora = {"enable_lora": True, "max_lora_rank": spec.lora.r, "max_loras": 1}
        self.llm = LLM(
            model=self.model_path,
            tokenizer=self.model_path,
            seed=spec.seed,
            dtype=str(compute_dtype(spec.dtype, torch.device("cuda"))).removeprefix("torch."),
            gpu_memory_utilization=gpu_memory_utilization,
            logprobs_mode="processed_logprobs",
            worker_extension_cls=WORKER_EXTENSION,
            enable_prefix_caching=True,
            **lora,
        )
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
            raise NotImplementedError(
                "the vLLM sampler does not take images yet: use resources.sampler_backend 'hf'"
            )
        from vllm import SamplingParams

        if not prompts:
            return []
        params = [
            SamplingParams(
                n=1,
                temperature=max(temperature, 0.0),
                top_p=1.0,
                top_k=-1 if temperature > 0 else 1,
                max_tokens=max_new_tokens,
                logprobs=0,  # only the sampled token's log-prob
                stop_token_ids=self.stop_token_ids,
                seed=None if seed is None else seed + i,  # per request: batch-independent
                detokenize=False,
                skip_special_tokens=False,
            )
            for i in range(len(prompts))
        ]
        requests = [{"prompt_token_ids": list(p)} for p in prompts]
        outputs = self.llm.generate(
            requests, sampling_params=params, lora_request=self._lora_request, use_tqdm=False
        )
        return [self._result(out.outputs[0]) for out in outputs]

    def _result(self, completion: Any) -> SampleResult:
        tokens = [int(t) for t in completion.token_ids]
        logprobs = [
            float(step[tok].logprob) for tok, step in zip(tokens, completion.logprobs, strict=True)
        ]
        stopped = (
            completion.finish_reason == "stop"
            and bool(tokens)
            and tokens[-1] in self.stop_token_ids
        )
        return SampleResult(tokens, logprobs, "stop" if stopped else "length")

    def set_weights(self, weights: tuple[dict[str, torch.Tensor], int]) -> int:
        """Weight sync from ``TorchTrainer.get_weights()``: full weights in place, or a new
        LoRA adapter version."""
        state, version = weights
        if self.spec.lora.enabled:
            self._load_adapter(state, version)
        else:
            self.llm.collective_rpc("flowrl_load_weights", args=(state,))
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights
        self.weights_version = version
        return version

    def _load_adapter(self, state: dict[str, torch.Tensor], version: int) -> None:
        from peft import LoraConfig
        from vllm.lora.request import LoRARequest

        path = os.path.join(self._adapter_root, f"adapter-v{version}")
        os.makedirs(path, exist_ok=True)
        config = LoraConfig(
            r=self.spec.lora.r,
            lora_alpha=self.spec.lora.alpha,
            lora_dropout=0.0,
            target_modules=list(self.spec.lora.target_modules),
            task_type="CAUSAL_LM",
            base_model_name_or_path=self.model_path,
        )
        config.save_pretrained(path)
        save_file(
            {k: v.contiguous() for k, v in state.items()}, f"{path}/adapter_model.safetensors"
        )
        previous = self._lora_request
        # vLLM caches adapters by integer id: a new id per version forces a fresh load.
        self._lora_request = LoRARequest(f"policy-v{version}", version + 1, path)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)

    def get_weights_version(self) -> int:
        return self.weights_version
