# ruff: noqa: E501  (the chat templates are data, one Jinja statement per line)
"""Tiny offline models of public chat-model families, built in seconds for tests.

Each fixture is a plain Hugging Face folder: a random-weight model of the family's
architecture (Qwen2, Qwen3, Llama, Mistral), a byte-level BPE tokenizer trained here with ``tokenizers``
(the family's special tokens, and its tool/think tags as added non-special tokens), a chat
template written from the family's public format description, and a ``generation_config.json``
listing the family's eos ids. Nothing is downloaded.

- ``chatml`` (Qwen2.5 style): a default system message when the conversation has none;
  ``<|im_start|>role\\n…<|im_end|>\\n``; tool results as a user turn wrapped in
  ``<tool_response>``; eos ids ``<|im_end|>`` and ``<|endoftext|>``.
- ``qwen3``: ChatML without a default system message; an assistant turn's ``<think>`` block is
  kept only after the last user message (and the final assistant turn always gets one).
- ``llama3`` (3.1 style): BOS in the template (and, like the real tokenizer, added by
  ``encode``), a system header with a knowledge date, contents trimmed, tool results in an
  ``ipython`` turn, ``<|eot_id|>`` after every message; no pad token; eos ids
  ``<|end_of_text|>``, ``<|eom_id|>``, ``<|eot_id|>``.
- ``gemma3`` (Gemma 3 style, on a Llama architecture): BOS in the template (and added by
  ``encode``), ``<start_of_turn>user\n…<end_of_turn>\n``, the assistant role written ``model``,
  contents trimmed, a system message folded into the first user turn; the template raises on
  any other role and when user and assistant turns do not alternate; eos ids ``<eos>``,
  ``<end_of_turn>``.
- ``mistral`` (Mistral instruct style, Mistral architecture): BOS in the template (and added by
  ``encode``), ``[INST] … [/INST]`` around each user turn (control tokens), the reply and
  ``</s>`` after it, a system message prefixed to the first user turn; raises like Gemma's;
  eos id ``</s>``.

Tool calls (``tools`` given to the template, assistant messages with ``tool_calls``), as the
families' public templates write them:

- ``chatml`` and ``qwen3`` (Hermes style): a ``# Tools`` block in the system message, one JSON
  definition per line inside ``<tools></tools>`` (``chatml`` keeps its default system text
  before it); an assistant tool call as ``<tool_call>\\n{"name": …, "arguments": …}\\n</tool_call>``
  (several calls one after another); tool results as above;
- ``llama3`` (3.1 JSON tool calling): ``Environment: ipython`` in the system header, the
  definitions as indented JSON at the head of the first user message, an assistant tool call as
  the JSON object ``{"name": …, "parameters": …}`` (one call per turn; more raise, as 3.1's own
  template does), tool results in an ``ipython`` turn.

A conversation without tools renders exactly as before tools were added (other tests rely on
it). Llama 3.1's own template writes a string tool result through ``tojson`` (quoted); the
fixture trims it, as it always has.

``teach`` makes a fixture answer every prompt with one fixed reply (greedy), so that real
sampling produces canonical, multi-turn episodes whose text re-renders to the same tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

HERMES = {
    "HERMES_TOOLS_OPEN": r"""'# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>'""",
    "HERMES_TOOLS_CLOSE": r"""'\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'""",
    "HERMES_CALL": r"""{%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
{{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' + (call.arguments if call.arguments is string else call.arguments | tojson) + '}\n</tool_call>' -}}""",
}
"""Qwen's tool syntax (Hermes style), as its templates write it: the ``# Tools`` block of the
system message (a definition per line inside ``<tools></tools>``), and an assistant tool call
(``tool_call`` in the loop) as a ``<tool_call>`` JSON block."""


def _hermes(template: str) -> str:
    for name, jinja in HERMES.items():
        template = template.replace(name, jinja)
    return template


CHATML_TEMPLATE = _hermes(
    r"""
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content -}}{%- else -%}{{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' -}}{%- endif -%}
{{- '\n\n' + HERMES_TOOLS_OPEN -}}
{%- for tool in tools -%}{{- '\n' + tool | tojson -}}{%- endfor -%}
{{- HERMES_TOOLS_CLOSE -}}
{%- elif messages[0].role == 'system' -%}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if message.role == 'system' and loop.first -%}
{%- elif message.role == 'user' or message.role == 'system' -%}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' and message.tool_calls -%}
{{- '<|im_start|>assistant' -}}
{%- if message.content -%}{{- '\n' + message.content -}}{%- endif -%}
{%- for tool_call in message.tool_calls -%}
{{- '\n' -}}
HERMES_CALL
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' + message.content + '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""
)

QWEN3_TEMPLATE = _hermes(
    r"""
{%- if tools -%}
{{- '<|im_start|>system\n' -}}
{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\n\n' -}}{%- endif -%}
{{- HERMES_TOOLS_OPEN -}}
{%- for tool in tools -%}{{- '\n' + tool | tojson -}}{%- endfor -%}
{{- HERMES_TOOLS_CLOSE -}}
{%- endif -%}
{%- set ns = namespace(last_query=-1) -%}
{%- for message in messages -%}
{%- if message.role == 'user' and not message.content.startswith('<tool_response>') -%}
{%- set ns.last_query = loop.index0 -%}
{%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
{%- if message.role == 'system' and loop.first and tools -%}
{%- elif message.role == 'user' or message.role == 'system' -%}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- elif message.role == 'assistant' -%}
{%- set content = message.content if message.content is string else '' -%}
{%- set reasoning = '' -%}
{%- if '</think>' in content -%}
{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}
{%- set content = content.split('</think>')[-1].lstrip('\n') -%}
{%- endif -%}
{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}
{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') -}}
{%- else -%}
{{- '<|im_start|>assistant\n' + content -}}
{%- endif -%}
{%- for tool_call in message.tool_calls or [] -%}
{%- if (loop.first and content) or not loop.first -%}{{- '\n' -}}{%- endif -%}
HERMES_CALL
{%- endfor -%}
{{- '<|im_end|>\n' -}}
{%- elif message.role == 'tool' -%}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
{{- '\n<tool_response>\n' + message.content + '\n</tool_response>' -}}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\n' -}}
{%- if enable_thinking is defined and enable_thinking is false -%}{{- '<think>\n\n</think>\n\n' -}}{%- endif -%}
{%- endif -%}
"""
)

LLAMA3_TEMPLATE = r"""
{{- bos_token -}}
{%- if tools is not defined -%}{%- set tools = none -%}{%- endif -%}
{%- if messages[0].role == 'system' -%}
{%- set system = messages[0].content | trim -%}
{%- set rest = messages[1:] -%}
{%- else -%}
{%- set system = '' -%}
{%- set rest = messages -%}
{%- endif -%}
{{- '<|start_header_id|>system<|end_header_id|>\n\n' -}}
{%- if tools is not none -%}{{- 'Environment: ipython\n' -}}{%- endif -%}
{{- 'Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n' -}}
{{- system + '<|eot_id|>' -}}
{%- if tools is not none -%}
{%- if not rest -%}{{- raise_exception('Cannot put tools in the first user message when there is no first user message!') -}}{%- endif -%}
{{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
{{- 'Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\n\n' -}}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.\n\n' -}}
{%- for t in tools -%}{{- t | tojson(indent=4) + '\n\n' -}}{%- endfor -%}
{{- rest[0].content | trim + '<|eot_id|>' -}}
{%- set rest = rest[1:] -%}
{%- endif -%}
{%- for message in rest -%}
{%- if message.role == 'tool' or message.role == 'ipython' -%}
{{- '<|start_header_id|>ipython<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' -}}
{%- elif message.role == 'assistant' and message.tool_calls -%}
{%- if message.tool_calls | length != 1 -%}{{- raise_exception('This model only supports single tool-calls at once!') -}}{%- endif -%}
{%- set call = message.tool_calls[0].function if message.tool_calls[0].function is defined else message.tool_calls[0] -%}
{{- '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "' + call.name + '", "parameters": ' + call.arguments | tojson + '}<|eot_id|>' -}}
{%- else -%}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\n\n' + message.content | trim + '<|eot_id|>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}{%- endif -%}
"""

GEMMA3_TEMPLATE = r"""
{{- bos_token -}}
{%- if messages[0].role == 'system' -%}
{%- set first_user_prefix = messages[0].content + '\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set first_user_prefix = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if message.role != 'user' and message.role != 'assistant' -%}
{{- raise_exception('Only user and assistant roles are supported after an optional system message') -}}
{%- endif -%}
{%- if (message.role == 'user') != (loop.index0 % 2 == 0) -%}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
{%- endif -%}
{%- set role = 'model' if message.role == 'assistant' else message.role -%}
{{- '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + message.content | trim + '<end_of_turn>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<start_of_turn>model\n' -}}{%- endif -%}
"""

MISTRAL_TEMPLATE = r"""
{{- bos_token -}}
{%- if messages[0].role == 'system' -%}
{%- set system_prefix = messages[0].content + '\n\n' -%}
{%- set loop_messages = messages[1:] -%}
{%- else -%}
{%- set system_prefix = '' -%}
{%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
{%- if (message.role == 'user') != (loop.index0 % 2 == 0) -%}
{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
{%- endif -%}
{%- if message.role == 'user' -%}
{{- '[INST] ' + (system_prefix if loop.first else '') + message.content + ' [/INST]' -}}
{%- elif message.role == 'assistant' -%}
{{- message.content + eos_token -}}
{%- else -%}
{{- raise_exception('Only user and assistant roles are supported!') -}}
{%- endif -%}
{%- endfor -%}
"""

NO_SYSTEM_TEMPLATE = (
    "{%- if messages[0].role == 'system' -%}"
    "{{- raise_exception('System role not supported') -}}{%- endif -%}" + MISTRAL_TEMPLATE
)
"""Mistral instruct style that refuses a system message (as some instruct templates do)."""

COUNTING_TEMPLATE = r"""
{{- '<|im_start|>system\nThis conversation has ' + (messages | length | string) + ' messages.<|im_end|>\n' -}}
{%- for message in messages -%}
{{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}
"""
"""A template that cannot be rendered incrementally: its system line counts the messages."""

TOOL_CALL_TAGS = ("<tool_call>", "</tool_call>")
TAGS = (*TOOL_CALL_TAGS, "<tool_response>", "</tool_response>")


@dataclass(frozen=True)
class Family:
    """How to build one family's fixture."""

    name: str
    architecture: str
    specials: tuple[str, ...]
    """Special tokens, in id order (ids 0..n-1)."""
    tags: tuple[str, ...]
    """Added non-special tokens (decoded with the text)."""
    template: str
    eos: str
    """The tokenizer's eos token (what an instruct model's tokenizer_config names)."""
    generation_eos: tuple[str, ...]
    pad: str | None
    bos: str | None = None
    bos_in_encode: bool = False
    """The tokenizer's post-processor prepends BOS on ``encode`` (Llama 3's does)."""


QWEN_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
LLAMA_SPECIALS = (
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
)
GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")
MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]")
FAMILIES: dict[str, Family] = {
    "chatml": Family(
        "chatml",
        "qwen2",
        QWEN_SPECIALS,
        TAGS,
        CHATML_TEMPLATE,
        eos="<|im_end|>",
        generation_eos=("<|im_end|>", "<|endoftext|>"),
        pad="<|endoftext|>",
    ),
    "qwen3": Family(
        "qwen3",
        "qwen3",
        QWEN_SPECIALS,
        (*TAGS, "<think>", "</think>"),
        QWEN3_TEMPLATE,
        eos="<|im_end|>",
        generation_eos=("<|im_end|>", "<|endoftext|>"),
        pad="<|endoftext|>",
    ),
    "llama3": Family(
        "llama3",
        "llama",
        LLAMA_SPECIALS,
        (),
        LLAMA3_TEMPLATE,
        eos="<|eot_id|>",
        generation_eos=("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"),
        pad=None,
        bos="<|begin_of_text|>",
        bos_in_encode=True,
    ),
    "gemma3": Family(
        "gemma3",
        "llama",
        GEMMA_SPECIALS,
        TAGS,
        GEMMA3_TEMPLATE,
        eos="<eos>",
        generation_eos=("<eos>", "<end_of_turn>"),
        pad="<pad>",
        bos="<bos>",
        bos_in_encode=True,
    ),
    "mistral": Family(
        "mistral",
        "mistral",
        MISTRAL_SPECIALS,
        TAGS,
        MISTRAL_TEMPLATE,
        eos="</s>",
        generation_eos=("</s>",),
        pad=None,
        bos="<s>",
        bos_in_encode=True,
    ),
}
STRICT = ("gemma3", "mistral")
"""The families whose templates accept only alternating user and assistant turns."""
NO_SYSTEM = Family(
    "no-system",
    "mistral",
    MISTRAL_SPECIALS,
    TAGS,
    NO_SYSTEM_TEMPLATE,
    eos="</s>",
    generation_eos=("</s>",),
    pad=None,
    bos="<s>",
    bos_in_encode=True,
)
BROKEN = Family(
    "counting",
    "qwen2",
    QWEN_SPECIALS,
    TAGS,
    COUNTING_TEMPLATE,
    eos="<|im_end|>",
    generation_eos=("<|im_end|>",),
    pad="<|endoftext|>",
)

_CORPUS = [
    "You are a helpful assistant. Answer with the calculator when it helps.",
    'What is 12 * 34? Use the calculator: <tool_call>{"expr": "12*34"}</tool_call>',
    "The answer is 408. error: at most 2 calls. invalid: write row,col",
    "Board:\n . X O\n O . X\n . . .\nYour move (row,col):",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024",
    "<think>\nI add the numbers.\n</think>\n\n0123456789 + - * / = ( ) , . : ; ! ?",
    "system user assistant tool ipython think response call expr",
]


def build_tokenizer(family: Family, vocab_size: int = 700) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with the family's special tokens (ids first) and tags."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(family.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_CORPUS * 4, trainer=trainer)
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.tags])
    if family.bos_in_encode:
        bos_id = backend.token_to_id(family.bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A",
            pair=f"{family.bos} $A $B",
            special_tokens=[(family.bos, bos_id)],
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    extra: dict[str, Any] = {"pad_token": family.pad} if family.pad else {}
    if family.bos:
        extra["bos_token"] = family.bos
    # transformers' sanitize_control_tokens writes the added tokens that the template's literals
    # contain as plain text when a message holds them. The fixtures keep the set they had before
    # their templates wrote tool calls: a <tool_call> in an environment's text stays one token
    # (tests/test_model_families.py's tool_math episodes rely on it).
    control = [t for t in family.tags if t in family.template and t not in TOOL_CALL_TAGS]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=family.eos,
        chat_template=family.template.strip(),
        clean_up_tokenization_spaces=False,
        chat_control_tokens=[*family.specials, *control],
        **extra,
    )


TEXT_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
)
"""Every fixture's text model: 2 layers of width 64."""


def build_family(family: Family, out_dir: str | Path, seed: int = 0) -> str:
    """Write the family's tiny random-weight model, tokenizer, template and generation config
    to ``out_dir``; returns it."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(family)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (*family.specials, *family.tags)}
    eos_ids = [ids[t] for t in family.generation_eos]
    shape = dict(
        vocab_size=len(tokenizer),
        **TEXT_SHAPE,
        tie_word_embeddings=True,
        bos_token_id=ids.get(family.bos) if family.bos else None,
        eos_token_id=eos_ids[0],
        pad_token_id=ids.get(family.pad) if family.pad else None,
    )
    config_cls, model_cls = {
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[family.architecture]
    if family.architecture == "qwen3":
        shape["head_dim"] = 16
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config_cls(**shape))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    generation = {"eos_token_id": eos_ids, "do_sample": True, "temperature": 0.7}
    if family.bos:
        generation["bos_token_id"] = ids[family.bos]
    if family.pad:
        generation["pad_token_id"] = ids[family.pad]
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return str(out)


def teach(folder: str, conversations: list[list[int]], masks: list[list[int]], steps: int = 150):
    """Fit the model in ``folder`` to the mask-1 tokens of ``conversations`` (plain AdamW,
    full batch) and save it back: a fixture that answers its episodes' prompts as taught."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    width = max(len(c) for c in conversations)
    ids = torch.zeros((len(conversations), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    labels = torch.full_like(ids, -100)
    for i, (tokens, mask) in enumerate(zip(conversations, masks, strict=True)):
        ids[i, : len(tokens)] = torch.tensor(tokens)
        attention[i, : len(tokens)] = 1
        labels[i, : len(tokens)] = torch.tensor(
            [t if m else -100 for t, m in zip(tokens, mask, strict=True)]
        )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        for _ in range(steps):
            loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    model.save_pretrained(folder)
    return float(loss.detach())


VISION_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN3_VL = Family(
    "qwen3_vl",
    "qwen3",
    (*QWEN_SPECIALS, *VISION_SPECIALS),
    FAMILIES["qwen3"].tags,
    QWEN3_TEMPLATE,
    eos="<|im_end|>",
    generation_eos=("<|im_end|>", "<|endoftext|>"),
    pad="<|endoftext|>",
)
"""Qwen3's chat format with Qwen-VL's vision tokens, each one token (the cookbook's
``qwen3_vl_instruct`` renderer wraps an image in ``<|vision_start|>`` … ``<|vision_end|>``)."""


def build_qwen3_vl(out_dir: str | Path, seed: int = 0) -> str:
    """A tiny random-weight Qwen3-VL (a 2-block vision tower, 16-pixel patches merged 2x2: a
    64x64 image is 4 tokens; the ``qwen3_vl`` family's tokenizer) and its image processor (the
    PIL one), in ``out_dir``: ``AutoModelForImageTextToText`` and ``AutoImageProcessor`` load
    it, as the cookbook's renderer does."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(QWEN3_VL)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN3_VL.specials}
    text = dict(
        vocab_size=len(tokenizer),
        **TEXT_SHAPE,
        head_dim=16,
        rope_scaling={
            "rope_type": "default",
            "mrope_section": [2, 3, 3],
            "mrope_interleaved": True,
        },
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
    )
    vision = dict(
        depth=2,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[1],
    )
    config = Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3VLForConditionalGeneration(config)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    Qwen2VLImageProcessorPil(
        patch_size=16,
        merge_size=2,
        temporal_patch_size=2,
        min_pixels=32 * 32,
        max_pixels=128 * 128,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
    ).save_pretrained(out)
    eos = [ids[t] for t in QWEN3_VL.generation_eos]
    generation = {"eos_token_id": eos, "pad_token_id": ids["<|endoftext|>"]}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return str(out)
