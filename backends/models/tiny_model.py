"""The tiny offline model: a character tokenizer trained on ``CHARSET``, its chat template, and
random-weight Llama models (tiny LLaVA vision-language models with ``spec.vision``,
``flowrl.backends.models.vlm``) built from a ``TinyModelSpec``.

Nothing here touches a model hub: a tiny model is built on this machine, its weights depend only
on its spec, and it is saved as a standard Hugging Face folder
(``flowrl.backends.models.model_folder`` reads it back) for tests and CPU experiments.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field, model_validator

from flowrl.infra.configfile import STRICT_MODEL_CONFIG

if TYPE_CHECKING:  # tokenizers and model classes load where they are built, not in a process
    # that only reads configs (``flowrl config``)
    from transformers import LlamaConfig, PreTrainedTokenizerFast

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
        description="Vision tower; enabled = a tiny LLaVA (``flowrl.backends.models.vlm``).",
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
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    (with ``spec.vision.enabled``: a tiny LLaVA and its processor, ``flowrl.backends.models.vlm``).

    Deterministic: the weights depend only on ``spec`` (the global torch RNG is left untouched).
    Writes a standard HF folder (safetensors) to ``out_dir`` and returns ``out_dir``.
    """
    if spec.vision.enabled:
        from flowrl.backends.models.vlm import (
            build_tiny_vlm,  # backends.models.vlm builds on this module
        )

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
