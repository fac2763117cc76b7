"""The OpenAI-compatible endpoint's models and sampling (``routes.create_app`` puts HTTP in
front; ``flowrl serve openai`` runs it).

A request's ``model`` names one of (never a path or URL: nothing a request says is opened as
one):
- a base model of the catalogue (``FLOWRL_TINKER_MODELS``, e.g. ``flowrl/tiny``);
- a registered version of the caller's namespace, ``models:/<name>/<N>`` or
  ``models:/<name>@<alias>`` (the name as the caller's jobs registered it: the namespace's
  prefix is added here, so a key never reaches another namespace's models);
- a Tinker sampler checkpoint of the caller's namespace, ``tinker://<run>/sampler_weights/<name>``
  (its base model with its LoRA adapter);
- a running job's current policy, ``job:<job name>``, a job of the caller's namespace (its
  record, ``backends.policy.live``): sampled by the job's own sampler on the job's Ray cluster (the
  endpoint's, ``FLOWRL_RAY_ADDRESS``: the stack's), between the job's calls, with whatever
  weights the job last synced; the answer's ``system_fingerprint`` names them
  (``weights-<version>``). The job's reproducibility is kept: each of its sampler calls seeds
  the sampler itself.

Each model is loaded once into this process (HF ``generate``:
``backends.engines.hf_sampler.HFSampler``) and kept while it is among the ``resident_models`` most
recently used; its chat format is its family's (``backends.models.chat.HFChatFormat``), as a job's.
Sampling a model is one call at a time.

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
from flowrl.infra.settings import RAY_NAMESPACE, get_settings, job_prefix, scoped_model_name
from flowrl.infra.storage import Storage

_JOB = re.compile(r"^job:([a-z0-9][a-z0-9-]{0,62})$")  # a job's name, as its config's
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
    """A loaded model: its sampler, chat format, context length, and the lock its calls take.
    A running job's policy (``_JobSampler``) also says which weights answered
    (``fingerprint``, set by each sampling)."""

    def __init__(self, name: str, sampler: Any, chat: Any, config: Any = None):
        self.name = name
        self.sampler = sampler
        self.chat = chat
        config = config if config is not None else sampler.model.config
        self.context_length = int(getattr(config, "max_position_embeddings", 0) or 0)
        self.vocab_size = len(chat.tokenizer)
        self.lock = threading.Lock()
        self.fingerprint: str | None = None


class _JobSampler:
    """A running job's first sampler (a Ray actor of the job's), sampled as a loaded model is.
    A job that ends while a request waits answers 404."""

    def __init__(self, job: str, policy: Any):
        self.job = job
        self.worker = policy.sampler_worker(0)

    def weights_version(self) -> int:
        return self._call(lambda: self.worker.get_weights_version())

    def sample(self, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int):
        return self._call(lambda: self.worker.sample(prompts, max_tokens, temperature, seed=seed))

    def _call(self, call: Any) -> Any:
        import ray

        try:
            return call()
        except (ray.exceptions.RayActorError, ValueError):
            raise ServiceError(404, f"model 'job:{self.job}': no running job") from None
        except ray.exceptions.RayTaskError as err:
            if isinstance(err.cause, KeyError):  # a shared worker's tenant that has left
                raise ServiceError(404, f"model 'job:{self.job}': no running job") from None
            raise


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
        self.job_chats: OrderedDict[str, tuple[Any, Any]] = OrderedDict()

    # ------------------------------------------------------------------- models

    def list_models(self, namespace: str | None) -> list[dict[str, Any]]:
        """The catalogue's base models, the namespace's running jobs (``job:<name>``) and its
        registered models (each as ``models:/<name>/<latest>`` and one entry per alias)."""
        ids = sorted(self.catalogue)
        ids += [f"job:{job}" for job in self._running_jobs(namespace)]
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

    def _running_jobs(self, namespace: str | None) -> list[str]:
        """The namespace's jobs whose policy runs on this endpoint's Ray cluster."""
        jobs_root = job_prefix("", namespace).rstrip("/")
        return [
            job
            for job in self.storage.list(jobs_root)
            if _JOB.match(f"job:{job}") and self._reachable(job, namespace, quiet=True)
        ]

    def _reachable(self, job: str, namespace: str | None, quiet: bool = False) -> Any:
        """The running policy of ``job`` (``backends.policy.live.LivePolicy``) if this endpoint can
        sample it; else None (``quiet``) or a 404 saying why."""
        import ray

        from flowrl.backends.policy import live
        from flowrl.backends.policy.tinker_handles import connect_service_ray

        def absent(why: str) -> None:
            if quiet:
                return None
            raise ServiceError(404, f"model 'job:{job}': {why}")

        found = live.find(self.storage, job_prefix(job, namespace))
        if found is None:
            return absent("no running job of that name in this namespace")
        if found.policy is None:
            return absent("its policy runs inside the job's own process, out of reach")
        try:
            connect_service_ray()
        except (RuntimeError, ConnectionError):
            return absent("this endpoint is on no Ray cluster (FLOWRL_RAY_ADDRESS)")
        if found.ray_address != ray.get_runtime_context().gcs_address:
            return absent(
                "the job runs on another Ray cluster than this endpoint's (a job of "
                "`flowrl stack up` runs on the stack's)"
            )
        try:
            ray.get_actor(found.policy.sampler, namespace=RAY_NAMESPACE)
        except ValueError:
            return absent("no running job of that name in this namespace")
        return found

    def _job_model(self, namespace: str | None, name: str) -> Served:
        """A running job's policy: its record read and its sampler found at each request (the
        job may have restarted its workers or ended since), its chat format loaded once."""
        from flowrl.backends.models.chat import HFChatFormat
        from flowrl.backends.models.model_uri import resolve_model_uri

        match = _JOB.match(name)
        if not match:
            raise ServiceError(400, f"model {name[:120]!r}: a running job is job:<job name>")
        found = self._reachable(match[1], namespace)
        with self.lock:
            loaded = self.job_chats.get(found.model_uri)
            if loaded is None:
                from transformers import AutoConfig

                folder = resolve_model_uri(found.model_uri, self.cache_dir)
                loaded = (HFChatFormat.from_folder(folder), AutoConfig.from_pretrained(folder))
                self.job_chats[found.model_uri] = loaded
                while len(self.job_chats) > 4 * self.limits.resident_models:
                    self.job_chats.popitem(last=False)
        return Served(name, _JobSampler(match[1], found.policy), *loaded)

    def model(self, namespace: str | None, name: Any) -> Served:
        """The loaded model ``name`` names for ``namespace`` (404 naming it when none)."""
        if not isinstance(name, str) or not name:
            raise ServiceError(400, "model: a model name is required")
        if name.startswith("job:"):
            return self._job_model(namespace, name)
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
        from flowrl.backends.engines.hf_sampler import HFSampler
        from flowrl.backends.models.chat import HFChatFormat
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
        from flowrl.backends.models.tinker_checkpoints import resolve_base_model

        return resolve_base_model(uri, self.cache_dir)

    def _registered_folder(self, namespace: str | None, name: str) -> str:
        from flowrl.backends.models.model_uri import resolve_model_uri

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

        from flowrl.backends.engines.tinker.types import read_tinker_lora
        from flowrl.backends.models.tinker_checkpoints import checkpoint_folder

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
            if isinstance(served.sampler, _JobSampler):
                served.fingerprint = f"weights-{served.sampler.weights_version()}"
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
