"""Models offline: a locally trained character tokenizer, tiny random Llama models (and tiny
LLaVA vision-language models, ``flowrl.backends.vlm``), model URIs.

Nothing here touches a model hub. A model is a plain Hugging Face folder (``config.json``,
``model.safetensors``, ``tokenizer.json`` ...) that lives on local disk, on any fsspec URL
(``s3://`` ...) or in the MLflow model registry (``models:/name@alias``); ``resolve_model_uri``
turns each of those into a local folder that ``load_tokenizer`` / ``load_causal_lm`` read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, model_validator
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from flowrl.infra.configfile import STRICT_MODEL_CONFIG

if TYPE_CHECKING:  # torch and the model classes load where weights do, not in the flow process
    import torch
    from transformers import LlamaConfig, PreTrainedModel

PAD_TOKEN = "<pad>"
UNK_TOKEN = "<unk>"
EOS_TOKEN = "<|end|>"
ROLES = ("system", "user", "assistant", "tool")
ROLE_TOKENS = tuple(f"<|{role}|>" for role in ROLES)
SPECIAL_TOKENS = (PAD_TOKEN, UNK_TOKEN, *ROLE_TOKENS, EOS_TOKEN)
"""In id order: ``<pad>`` is 0, ``<unk>`` 1, the role tokens 2-5, ``<|end|>`` 6."""
IMAGE_TOKEN = "<image>"
"""Placeholder of one image in a vision-language model's prompt (added after the characters, so
text ids are the same with and without it); the chat format repeats it once per image feature."""

CHARSET = "".join(chr(c) for c in range(32, 127)) + "\n\t"
"""Printable ASCII plus newline and tab: the characters the tokenizer knows (others: <unk>)."""

# Role tokens are written as literals (not '<|' + role + '|>') so that transformers'
# ``sanitize_control_tokens`` can tell the template's control tokens from message text.
# Every message renders alone ("<|role|>content<|end|>"): no BOS, no default system prompt, so
# rendering [m1..mk] equals concatenating the renders of m1..mk.
_ROLE_BLOCK = (
    "{%- if message.role == 'system' -%}<|system|>"
    "{%- elif message.role == 'user' -%}<|user|>"
    "{%- elif message.role == 'assistant' -%}<|assistant|>"
    "{%- elif message.role == 'tool' -%}<|tool|>"
    "{%- else -%}{{ raise_exception('unknown chat role: ' ~ message.role) }}"
    "{%- endif -%}"
)
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    + _ROLE_BLOCK
    + "{%- if message.content is defined -%}{{ message.content }}{%- endif -%}"
    "{%- for call in message.tool_calls | default([]) -%}"
    "<tool_call>{{ (call.function if call.function is defined else call) | tojson }}</tool_call>"
    "{%- endfor -%}"
    "<|end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>{%- endif -%}"
)
"""Jinja chat template: ``<|role|>content<|end|>`` per message, generation prompt ``<|assistant|>``.

Assistant tool calls (OpenAI shape ``{"type": "function", "function": {...}}``) are rendered after
the content as ``<tool_call>{json of the function}</tool_call>``."""


class TinyVisionSpec(BaseModel, title="Tiny vision tower"):
    """Shape of the vision tower that makes a tiny model a LLaVA vision-language model."""

    model_config = STRICT_MODEL_CONFIG

    enabled: bool = Field(
        False, description="Build a tiny LLaVA (CLIP vision tower + the Llama) that reads images."
    )
    image_size: int = Field(
        32, ge=8, le=1024, description="Side in pixels images are resized and cropped to."
    )
    patch_size: int = Field(
        8, ge=2, le=256, description="Vision patch side: (image_size/patch_size)^2 image tokens."
    )
    hidden_size: int = Field(64, ge=8, le=4096, description="Width of the vision tower.")
    num_layers: int = Field(2, ge=1, le=48, description="Vision transformer blocks.")
    num_heads: int = Field(
        4, ge=1, le=64, description="Vision attention heads (must divide hidden_size)."
    )
    intermediate_size: int = Field(128, ge=8, le=16384, description="Width of the vision MLP.")

    @model_validator(mode="after")
    def _shapes_fit(self) -> TinyVisionSpec:
        if self.image_size % self.patch_size:
            raise ValueError(
                f"image_size ({self.image_size}) must be divisible by "
                f"patch_size ({self.patch_size})"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        return self


class TinyModelSpec(BaseModel, title="Tiny model"):
    """Shape of a tiny random-weight causal LM built offline for tests and CPU experiments."""

    model_config = STRICT_MODEL_CONFIG

    architecture: Literal["llama"] = Field(
        "llama", description="Model family; Llama keeps the tokenizer round-trip exact."
    )
    hidden_size: int = Field(128, ge=8, le=8192, description="Width of the residual stream.")
    num_layers: int = Field(2, ge=1, le=64, description="Number of transformer blocks.")
    num_heads: int = Field(
        4, ge=1, le=128, description="Attention heads (must divide hidden_size); no GQA."
    )
    intermediate_size: int = Field(256, ge=8, le=32768, description="Width of the MLP.")
    max_position_embeddings: int = Field(
        256, ge=16, le=131072, description="Longest sequence (prompt + completion) in tokens."
    )
    seed: int = Field(0, ge=0, description="Seed of the random weights: same spec, same weights.")
    vision: TinyVisionSpec = Field(
        default_factory=TinyVisionSpec,
        description="Vision tower; enabled = a tiny LLaVA (``flowrl.backends.vlm``).",
    )

    @model_validator(mode="after")
    def _heads_divide_width(self) -> TinyModelSpec:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_heads ({self.num_heads})"
            )
        return self


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Train a character-level WordLevel tokenizer on ``CHARSET`` and wrap it for transformers.

    One token per character, so ``decode(encode(text)) == text`` for any text over ``CHARSET``
    (spaces included). Ids are deterministic: specials first (see ``SPECIAL_TOKENS``), then the
    characters in code-point order.
    """
    backend = Tokenizer(models.WordLevel(unk_token=UNK_TOKEN))
    # Split every character (newlines included) into its own pre-token; Fuse joins them back
    # with no separator on decode, which is what makes spaces round-trip.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    trainer = trainers.WordLevelTrainer(
        vocab_size=len(SPECIAL_TOKENS) + len(CHARSET),
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
    )
    backend.train_from_iterator([CHARSET], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=list(ROLE_TOKENS),
        padding_side="left",  # must go to the constructor, or save_pretrained forgets it
        clean_up_tokenization_spaces=False,
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(spec: TinyModelSpec, out_dir: str) -> str:
    """Build a random-weight ``LlamaForCausalLM`` plus ``build_tokenizer()`` and save both
    (with ``spec.vision.enabled``: a tiny LLaVA and its processor, ``flowrl.backends.vlm``).

    Deterministic: the weights depend only on ``spec`` (the global torch RNG is left untouched).
    Writes a standard HF folder (safetensors) to ``out_dir`` and returns ``out_dir``.
    """
    if spec.vision.enabled:
        from flowrl.backends.vlm import build_tiny_vlm  # backends.vlm builds on this module

        return build_tiny_vlm(spec, out_dir)
    import torch
    from transformers import LlamaForCausalLM

    tokenizer = build_tokenizer()
    tokenizer.model_max_length = spec.max_position_embeddings
    config = llama_config(spec, tokenizer)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    save_tokenizer(tokenizer, out_dir)
    return out_dir


def llama_config(spec: TinyModelSpec, tokenizer: PreTrainedTokenizerFast) -> LlamaConfig:
    """The Llama config of ``spec`` over ``tokenizer``'s vocabulary."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        intermediate_size=spec.intermediate_size,
        max_position_embeddings=spec.max_position_embeddings,
        # No BOS exists in the chat format; generate() only needs one for an empty prompt.
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=True,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: str) -> None:
    """``tokenizer.save_pretrained(out_dir)``, written so that transformers 4.x loads it too
    (older TRL and vLLM releases pin 4.x): transformers 5 names the class ``TokenizersBackend``
    and lists the extra special tokens as ``extra_special_tokens``, which 4.x reads as a
    mapping. The class becomes ``PreTrainedTokenizerFast`` (the same class in 5.x), the list
    ``additional_special_tokens`` (read by both), and the chat template is also inlined for
    4.x releases that do not read ``chat_template.jinja``."""
    tokenizer.save_pretrained(out_dir)
    path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    if isinstance(config.get("extra_special_tokens"), list):
        config["additional_special_tokens"] = config.pop("extra_special_tokens")
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    template = Path(out_dir) / "chat_template.jinja"
    if template.is_file():
        config["chat_template"] = template.read_text()
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def copy_model_files(src: str, dst: str) -> None:
    """Copy every file of model folder ``src`` that is not weights or ``config.json`` to
    ``dst``, byte for byte: tokenizer, chat template, generation config (its eos ids), processor
    settings. A trained policy is saved with these so that it reloads exactly as its base."""
    for path in sorted(Path(src).iterdir()):
        if path.is_file() and path.name != "config.json" and not path.name.startswith("."):
            if not path.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copyfile(path, Path(dst) / path.name)


def load_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """Load a tokenizer from a local HF folder (never ``AutoTokenizer``: see STACK_NOTES)."""
    return PreTrainedTokenizerFast.from_pretrained(path)


def pad_id(tokenizer: PreTrainedTokenizerFast) -> int:
    """The id batches are padded with: the tokenizer's pad token, else its eos (Llama 3 has no
    pad token); padded positions are masked out of attention and loss either way."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


def model_positions(path: str) -> int | None:
    """``max_position_embeddings`` of a local model folder (a VLM's text model's), if stated."""
    config = json.loads((Path(path) / "config.json").read_text())
    positions = config.get("max_position_embeddings")
    if positions is None:
        positions = (config.get("text_config") or {}).get("max_position_embeddings")
    return int(positions) if positions is not None else None


def is_vision_language(path: str) -> bool:
    """Whether the local HF folder ``path`` holds a vision-language model (its config has a
    ``vision_config``, e.g. LLaVA)."""
    config = json.loads((Path(path) / "config.json").read_text())
    return "vision_config" in config


def load_causal_lm(path: str, dtype: torch.dtype | None = None) -> PreTrainedModel:
    """Load a causal LM from a local HF folder, in eval mode (``dtype`` default float32); a
    vision-language folder (its config has a ``vision_config``, e.g. LLaVA) loads as
    ``AutoModelForImageTextToText``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    dtype = torch.float32 if dtype is None else dtype
    auto = AutoModelForImageTextToText if is_vision_language(path) else AutoModelForCausalLM
    return auto.from_pretrained(path, dtype=dtype).eval()


# --- model URIs -------------------------------------------------------------------------------

_MLFLOW_SCHEMES = ("models:/", "runs:/")
_COMPLETE_MARKER = ".flowrl-complete"
CACHE_BOOKKEEPING = (_COMPLETE_MARKER,)
"""Files the model cache adds to a model folder (left out when a cached model is copied)."""


LORA_EXPORT = "flowrl-lora"
"""The subfolder of an exported LoRA policy (``TorchTrainer.export_pretrained``) that keeps its
adapter (``adapter.safetensors``) and ``lora.json``: the base model's URI and LoRA settings."""


def lora_export(folder: str) -> dict[str, Any] | None:
    """``lora.json`` of an exported LoRA policy's folder (``base_model``: the URI it was
    trained on; ``lora``: its LoRA settings); None when the folder holds no adapter (a
    full-parameter policy, or one exported before adapters were kept)."""
    where = Path(folder) / LORA_EXPORT / "lora.json"
    if not where.is_file():
        return None
    meta = json.loads(where.read_text())
    if not isinstance(meta, dict) or not isinstance(meta.get("base_model"), str):
        raise ValueError(f"{where} is not a flowrl LoRA export (no base_model)")
    return meta


def resolve_model_uri(uri: str, cache_dir: str) -> str:
    """Return a local HF model folder (the one holding ``config.json``) for ``uri``.

    - a local path or ``file://`` URL: used in place;
    - ``models:/name@alias``, ``models:/name/version``, ``runs:/...``: downloaded from MLflow
      into ``cache_dir`` (an alias is resolved to its version first, so a moved alias is seen);
    - any other fsspec URL (``s3://`` ...): copied into ``cache_dir`` once, keyed by a hash of
      the URI (a copy is reused only when it completed).

    The folder may be the URI itself or nested one level below it (in an MLflow Model: below
    its ``artifacts/``, see ``backends.mlflow_model``). Raises
    ``FileNotFoundError`` (nothing there) or ``ValueError`` (unknown scheme) naming the URI.
    """
    if uri.startswith(_MLFLOW_SCHEMES):
        return _find_model_folder(_download_mlflow(uri, Path(cache_dir)), uri)
    if uri.startswith("file://") or "://" not in uri:
        local = Path(uri.removeprefix("file://")).expanduser()
        if not local.is_dir():
            raise FileNotFoundError(f"no model folder at {uri!r} ({local} is not a directory)")
        return _find_model_folder(local, uri)
    return _find_model_folder(_download_fsspec(uri, Path(cache_dir)), uri)


def check_model_source(uri: str) -> None:
    """Fail fast, before a job starts, when ``model.source`` cannot be a model: a local folder
    that is missing, unreadable or holds no ``config.json``; a registry name, version or alias
    that does not exist; an fsspec URL with no ``config.json``. ``"tiny"`` is always fine.
    Raises ``ValueError`` naming the source and what is wrong."""
    if uri == "tiny":
        return
    try:
        if uri.startswith(_MLFLOW_SCHEMES):
            pinned = _pin_registry_version(uri)
            if pinned is not None:
                from flowrl.infra.tracking import client

                name, _, version = pinned.removeprefix("models:/").rpartition("/")
                client().get_model_version(name, version)
            return
        if uri.startswith("file://") or "://" not in uri:
            local = Path(uri.removeprefix("file://")).expanduser()
            if not local.is_dir():
                raise ValueError("no such folder")
            if not os.access(local, os.R_OK | os.X_OK):
                raise ValueError("the folder is not readable")
            _find_model_folder(local, uri)
            return
        import fsspec

        fs, root = fsspec.core.url_to_fs(uri)
        if not (fs.exists(f"{root.rstrip('/')}/config.json") or fs.glob(f"{root}/*/config.json")):
            raise ValueError("no config.json there or one level below")
    except ValueError as err:
        raise ValueError(f"model.source {uri!r}: {err}") from None
    except Exception as err:  # registry or storage said no: name it, without a traceback
        raise ValueError(f"model.source {uri!r}: {type(err).__name__}: {err}") from None


def _cache_slot(cache_dir: Path, key: str) -> Path:
    return cache_dir / hashlib.sha256(key.encode()).hexdigest()[:16]


def tiny_model_key(spec: TinyModelSpec) -> str:
    """The cache key of a tiny model's shape (a text model's leaves its disabled vision section
    out): the same for a job's model and the Tinker API's ``tiny``, so both use one build."""
    shape = spec.model_dump(exclude=None if spec.vision.enabled else {"vision"})
    blob = json.dumps([shape], sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:12]


def tiny_model_slot(cache_dir: str, key: str) -> Path:
    """Where ``cached_tiny_model`` keeps the tiny model whose spec hashes to ``key``."""
    return Path(cache_dir) / f"tiny-{key}"


def cached_tiny_model(slot: Path) -> Path | None:
    """The complete tiny model at ``slot``, or None when it has not been built there."""
    return slot if _complete(slot) else None


def _complete(slot: Path) -> bool:
    """A cache slot holds a whole copy (``_fill_once`` marks it last)."""
    return (slot / _COMPLETE_MARKER).exists()


def build_tiny_model_once(spec: TinyModelSpec, slot: Path) -> Path:
    """``build_tiny_model(spec)`` into ``slot`` of a model cache, unless a complete build is
    there (it is the same: the weights depend only on the spec). Two processes building the
    same slot at once both finish, and one build is kept."""
    return _fill_once(slot, lambda tmp: build_tiny_model(spec, str(tmp)))


def _fill_once(slot: Path, fill: Any) -> Path:
    """Run ``fill(tmp_dir)`` and move the result to ``slot``, unless a complete copy is there."""
    if _complete(slot):
        return slot
    slot.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=slot.parent, prefix=f".{slot.name}-"))
    try:
        fill(tmp)
        (tmp / _COMPLETE_MARKER).touch()
        try:
            tmp.rename(slot)  # atomic; fails if another process's complete copy is there
        except OSError:
            if _complete(slot):
                return slot  # another job filled it first, and may be reading it: keep theirs
            shutil.rmtree(slot, ignore_errors=True)  # an incomplete leftover
            tmp.rename(slot)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return slot


def _download_fsspec(uri: str, cache_dir: Path) -> Path:
    import fsspec

    try:
        fs, root = fsspec.core.url_to_fs(uri)
    except (ValueError, ImportError) as err:
        raise ValueError(f"cannot open model URI {uri!r}: {err}") from err
    if not fs.isdir(root):
        raise FileNotFoundError(f"no model folder at {uri!r}")
    root = root.rstrip("/")
    listing = fs.find(root, detail=True)

    def fill(tmp: Path) -> None:
        # find() + get_file() per file avoids fsspec's trailing-slash rules for recursive get.
        for remote in listing:
            relative = remote[len(root) :].lstrip("/")
            target = tmp / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(remote, str(target))

    # Keyed by the URI and what is there now: a model written again at the same URI is copied
    # again, never served stale from the cache (which every home on a machine may share).
    version = sorted(
        (name, info.get("size"), _file_version(info)) for name, info in listing.items()
    )
    return _fill_once(_cache_slot(cache_dir, json.dumps([uri, version], default=str)), fill)


def _file_version(info: dict[str, Any]) -> Any:
    """What changes when a file is written again, from an fsspec listing entry (S3's ETag,
    else a modification time)."""
    for key in ("ETag", "etag", "LastModified", "last_modified", "mtime", "updated", "created"):
        if info.get(key) is not None:
            return info[key]
    return None


def _download_mlflow(uri: str, cache_dir: Path) -> Path:
    import mlflow
    from mlflow.exceptions import MlflowException

    pinned = _pin_registry_version(uri)
    key = f"{mlflow.get_registry_uri()}|{pinned or uri}"

    def fill(tmp: Path) -> None:
        try:
            mlflow.artifacts.download_artifacts(artifact_uri=pinned or uri, dst_path=str(tmp))
        except MlflowException as err:
            raise FileNotFoundError(f"cannot download model {uri!r} from MLflow: {err}") from err

    slot = _cache_slot(cache_dir, key)
    if pinned is None:  # e.g. models:/name/latest or runs:/ : may change, always fetch again
        shutil.rmtree(slot, ignore_errors=True)
    return _fill_once(slot, fill)


def pin_model_uri(uri: str) -> str:
    """``models:/name@alias`` -> the version the alias names now (``models:/name/7``); any other
    URI unchanged. A job pins its base model once, so that moving ``champion`` while it runs (or
    between two jobs) never mixes versions, and caches keyed by the URI stay correct."""
    return _pin_registry_version(uri) or uri


def _pin_registry_version(uri: str) -> str | None:
    """``models:/name@alias`` -> ``models:/name/<version>``; a numbered version stays; else None."""
    if not uri.startswith("models:/"):
        return None
    ref = uri.removeprefix("models:/").strip("/")
    if "@" in ref:
        from flowrl.infra.tracking import alias_version

        name, alias = ref.rsplit("@", 1)
        version = alias_version(name, alias)
        if version is None:
            raise FileNotFoundError(f"no registered model version for {uri!r}")
        return f"models:/{name}/{version}"
    name, _, version = ref.rpartition("/")
    return uri if name and version.isdigit() else None


def _find_model_folder(root: Path, uri: str) -> str:
    if (root / "config.json").is_file():
        return str(root)
    if (root / "MLmodel").is_file():  # a registered flowrl version: the pyfunc's HF artifact
        root = root / "artifacts"
    nested = sorted(p.parent for p in root.glob("*/config.json"))
    if len(nested) == 1:
        return str(nested[0])
    if nested:
        names = [p.name for p in nested]
        raise ValueError(f"model URI {uri!r} holds several model folders: {names}")
    raise FileNotFoundError(f"no config.json at {uri!r} or one level below it")
