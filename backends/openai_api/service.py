"""The OpenAI-compatible endpoint's models and sampling (``routes.create_app`` puts HTTP in
front; ``flowrl serve openai`` runs it).

A request's ``model`` names one of (never a path or URL: nothing a request says is opened as
one):
- a base model of the catalogue (``FLOWRL_TINKER_MODELS``, e.g. ``flowrl/tiny``);
- a registered version of the caller's namespace, ``models:/<name>/<N>`` or
  ``models:/<name>@<alias>`` (the name as the caller's jobs registered it: the namespace's
  prefix is added here, so a key never reaches another namespace's models);
- a Tinker sampler checkpoint of the caller's namespace, ``tinker://<run>/sampler_weights/<name>``
  (its base model with its LoRA adapter).

Each model is loaded once into this process (HF ``generate``: ``backends.hf_workers.HFSampler``)
and kept while it is among the ``resident_models`` most recently used; its chat format is its
family's (``backends.chat.HFChatFormat``), as a job's. Sampling a model is one call at a time.

Parameters the engine cannot honour are refused with a 400 naming them, never changed
silently: ``top_p`` other than 1, penalties, ``logit_bias``, ``response_format``, more than
``top_logprobs: 0``; of the tool parameters (``tools.py``), tools for a family that cannot
express them, ``tool_choice`` other than ``auto``/``none``, ``parallel_tool_calls: false``.
"""

from __future__ import annotations

import re
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from flowrl.infra.serving import Keys, ServiceError, ServingLimits
from flowrl.infra.settings import get_settings, scoped_model_name
from flowrl.infra.storage import Storage

_REGISTERED = re.compile(
    r"^models:/([A-Za-z0-9][A-Za-z0-9.-]{0,127})(?:/([0-9]{1,9})|@([A-Za-z0-9_-]{1,64}))$"
)
_SUPPORTED = {
    "model",
    "messages",
    "prompt",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "n",
    "stream",
    "stream_options",
    "seed",
    "stop",
    "logprobs",
    "top_logprobs",
    "user",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "parallel_tool_calls",
    "tools",
    "tool_choice",
    "store",
    "metadata",
}
_NEUTRAL = {"top_p": (1, 1.0), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0)}
"""Parameters accepted only at the value that changes nothing."""


@dataclass
class Limits(ServingLimits):
    """The serving layer's limits, plus the endpoint's own."""

    max_n: int = 16
    """Completions per request (``n``)."""
    max_tokens: int = 2048
    """Sampled tokens per completion."""
    resident_models: int = 2
    """Models kept loaded at once (least recently used unloaded first)."""


@dataclass
class Completion:
    """One sampled completion: its token ids, their log-probs and why it ended."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    text: str


class Served:
    """A loaded model: its sampler, chat format, context length, and the lock its calls take."""

    def __init__(self, name: str, sampler: Any, chat: Any):
        self.name = name
        self.sampler = sampler
        self.chat = chat
        config = sampler.model.config
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.vocab_size = len(chat.tokenizer)
        self.lock = threading.Lock()


class OpenAIService:
    """The endpoint's state and verbs."""

    def __init__(
        self,
        keys: dict[str, str] | None = None,
        catalogue: dict[str, str] | None = None,
        storage_url: str | None = None,
        limits: Limits | None = None,
    ):
        settings = get_settings()
        self.keys = Keys(keys)
        self.catalogue = dict(catalogue if catalogue is not None else settings.tinker_models)
        self.storage = Storage(storage_url or settings.storage_root)
        self.cache_dir = settings.model_cache_dir
        self.limits = limits or Limits()
        self.lock = threading.RLock()
        self.loaded: OrderedDict[tuple[str | None, str], Served] = OrderedDict()

    # ------------------------------------------------------------------- models

    def list_models(self, namespace: str | None) -> list[dict[str, Any]]:
        """The catalogue's base models and the namespace's registered models (each as
        ``models:/<name>/<latest>`` and one entry per alias)."""
        ids = sorted(self.catalogue)
        for name, latest, aliases in self._registered(namespace):
            ids += [f"models:/{name}/{latest}", *(f"models:/{name}@{a}" for a in sorted(aliases))]
        owner = namespace or "flowrl"
        return [
            {
                "id": i,
                "object": "model",
                "created": 0,
                "owned_by": "flowrl" if i in self.catalogue else owner,
            }
            for i in ids
        ]

    def _registered(self, namespace: str | None) -> list[tuple[str, str, list[str]]]:
        from flowrl.infra.tracking import client

        prefix = scoped_model_name("", namespace)
        found = []
        for model in client().search_registered_models(max_results=200):
            if not model.name.startswith(prefix) or (not namespace and "_" in model.name):
                continue
            latest = max((int(v.version) for v in model.latest_versions or []), default=0)
            if latest:
                aliases = list(getattr(model, "aliases", {}) or {})
                found.append((model.name[len(prefix) :], str(latest), aliases))
        return found

    def model(self, namespace: str | None, name: Any) -> Served:
        """The loaded model ``name`` names for ``namespace`` (404 naming it when none)."""
        if not isinstance(name, str) or not name:
            raise ServiceError(400, "model: a model name is required")
        # A base model of the catalogue is every namespace's: loaded once for all of them.
        key = (None if name in self.catalogue else namespace, name)
        with self.lock:
            served = self.loaded.get(key)
            if served is not None:
                self.loaded.move_to_end(key)
                return served
            served = self._load(namespace, name)
            self.loaded[key] = served
            while len(self.loaded) > self.limits.resident_models:
                self.loaded.popitem(last=False)
            return served

    def _load(self, namespace: str | None, name: str) -> Served:
        from flowrl.backends.chat import HFChatFormat
        from flowrl.backends.hf_workers import HFSampler
        from flowrl.backends.types import LoraSettings, WorkerSpec

        lora, adapter = LoraSettings(), None
        if name in self.catalogue:
            folder = self._base_folder(self.catalogue[name])
        elif name.startswith("models:/"):
            folder = self._registered_folder(namespace, name)
        elif name.startswith("tinker://"):
            folder, lora, adapter = self._tinker_sampler(namespace, name)
        else:
            raise ServiceError(404, f"no model {name[:120]!r} (see GET /v1/models)")
        sampler = HFSampler(WorkerSpec(model_uri=folder, cache_dir=self.cache_dir, lora=lora))
        if adapter is not None:
            sampler.set_weights((adapter, 0))
        return Served(name, sampler, HFChatFormat.from_folder(sampler.model_path))

    def _base_folder(self, uri: str) -> str:
        from flowrl.backends.tinker.checkpoints import resolve_base_model

        return resolve_base_model(uri, self.cache_dir)

    def _registered_folder(self, namespace: str | None, name: str) -> str:
        from flowrl.backends.model_uri import resolve_model_uri

        match = _REGISTERED.match(name)
        if not match:
            raise ServiceError(
                400,
                f"model {name[:120]!r}: a registered version is models:/<name>/<N> or "
                "models:/<name>@<alias>",
            )
        scoped = scoped_model_name(match[1], namespace)
        uri = f"models:/{scoped}/{match[2]}" if match[2] else f"models:/{scoped}@{match[3]}"
        try:
            return resolve_model_uri(uri, self.cache_dir)
        except Exception:  # noqa: BLE001 - the registry said no: the caller's model is unknown
            raise ServiceError(404, f"no model {name!r} in this namespace") from None

    def _tinker_sampler(self, namespace: str | None, name: str) -> tuple[str, Any, Any]:
        from safetensors.torch import load as load_safetensors

        from flowrl.backends.tinker.checkpoints import checkpoint_folder
        from flowrl.backends.tinker.types import read_tinker_lora

        try:
            _, kind, folder = checkpoint_folder(self.storage, namespace, name)
        except ServiceError as err:
            raise ServiceError(
                404 if err.status == 404 else 400, f"model {name!r}: {err}"
            ) from None
        record = self.storage.read_json(f"{folder}/checkpoint.json")
        base = record.get("base_model")
        if base not in self.catalogue:
            raise ServiceError(404, f"model {name!r}: its base model {base!r} is not served here")
        lora, _ = read_tinker_lora(record["lora"])
        adapter = load_safetensors(self.storage.read_bytes(f"{folder}/adapter.safetensors"))
        return self._base_folder(self.catalogue[base]), lora, adapter

    # ------------------------------------------------------------------- sampling

    def sample(
        self,
        served: Served,
        prompt: list[int],
        body: dict[str, Any],
    ) -> list[Completion]:
        """``n`` completions of ``prompt`` as ``body`` asks (max tokens, temperature, seed,
        stop strings), each cut at its first stop string."""
        n = _int(body, "n", 1, 1, self.limits.max_n)
        asked = body.get("max_completion_tokens", body.get("max_tokens"))
        room = (
            served.context_length - len(prompt) if served.context_length else self.limits.max_tokens
        )
        if room < 1:
            raise ServiceError(
                400,
                f"messages: the prompt ({len(prompt)} tokens) fills the model's context "
                f"of {served.context_length}",
            )
        if asked is None:
            max_tokens = min(room, self.limits.max_tokens)
        else:
            max_tokens = _int({"max_tokens": asked}, "max_tokens", 16, 1, self.limits.max_tokens)
            if max_tokens > room:
                raise ServiceError(
                    400,
                    f"max_tokens: the prompt ({len(prompt)} tokens) + {max_tokens} exceeds "
                    f"the model's context of {served.context_length}",
                )
        temperature = _float(body, "temperature", 1.0, 0.0, 2.0)
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ServiceError(400, "seed: an integer")
        stops = _stops(body.get("stop"))
        bad = [t for t in prompt if not 0 <= t < served.vocab_size]
        if bad:
            raise ServiceError(400, f"prompt: token id {bad[0]} is outside the vocabulary")
        with served.lock:
            results = served.sampler.sample(
                [prompt] * n,
                max_tokens,
                temperature,
                seed=secrets.randbits(62) if seed is None else seed % 2**62,
            )
        return [_completion(served.chat, r, stops) for r in results]


def check_parameters(body: dict[str, Any]) -> None:
    """400 naming the first parameter this engine cannot honour."""
    for key, value in body.items():
        if key not in _SUPPORTED:
            if value is None:
                continue
            raise ServiceError(400, f"{key}: not supported by this endpoint")
        if key in _NEUTRAL and value is not None and value not in _NEUTRAL[key]:
            raise ServiceError(400, f"{key}: only {_NEUTRAL[key][0]} is supported")
    if body.get("top_logprobs") not in (None, 0):
        raise ServiceError(400, "top_logprobs: only 0 is supported (the sampled token's)")


def _completion(chat: Any, result: Any, stops: list[str]) -> Completion:
    tokens, logprobs = list(result.tokens), list(result.logprobs)
    finish = "stop" if result.finish_reason == "stop" else "length"
    body = tokens[:-1] if finish == "stop" else tokens
    if stops:
        for end in range(1, len(body) + 1):
            text = chat.decode(body[:end])
            hit = min((text.find(s) for s in stops if s in text), default=-1)
            if hit >= 0:
                return Completion(tokens[:end], logprobs[:end], "stop", text[:hit])
    return Completion(tokens, logprobs, finish, chat.decode(body))


def _stops(value: Any) -> list[str]:
    if value is None:
        return []
    items = [value] if isinstance(value, str) else value
    if (
        not isinstance(items, list)
        or len(items) > 4
        or not all(isinstance(s, str) and 0 < len(s) <= 64 for s in items)
    ):
        raise ServiceError(400, "stop: a string or up to 4 strings of 1 to 64 characters")
    return items


def _int(body: dict[str, Any], key: str, default: int, low: int, high: int) -> int:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise ServiceError(400, f"{key}: an integer from {low} to {high}, got {str(value)[:40]}")
    return value


def _float(body: dict[str, Any], key: str, default: float, low: float, high: float) -> float:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not low <= value <= high:
        raise ServiceError(400, f"{key}: a number from {low:g} to {high:g}, got {str(value)[:40]}")
    return float(value)
