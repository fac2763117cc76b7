"""Chat formats: any Hugging Face chat template rendered one message at a time, token-exactly.

The agent loop never re-encodes a conversation: it appends the opening prompt, then each
sampled turn, then each observation, as token ids. That is only correct if the pieces add up to
what the model's own template renders for the whole conversation. Real templates are not
concatenative: ChatML writes ``\\n`` after ``<|im_end|>``, Qwen2.5 inserts a default system
message, Llama 3 opens with BOS and a dated system header. Rendering a message alone repeats or
drops those. So an observation is rendered as a *suffix*: a fixed base conversation (a user
message and an assistant reply) plus the new message is rendered whole, and only what follows
the base reply's end-of-turn token is kept, which is the template's separator after that
token, the new message and the generation prompt.

Families (``model.chat_format``; ``auto`` picks one from the template, see ``FAMILIES``) differ
only in what the template does to earlier turns that the loop does not repeat:

- ``qwen3`` drops the ``<think>`` block of an assistant turn that precedes the last user
  message (and gives the final assistant turn an empty one when it has none). The policy keeps
  its own earlier turns as it sampled them; a sampled turn's text after ``</think>`` is what the
  environment sees.
- ``llama3`` and ``gemma3`` trim the whitespace around every message's content; a sampled turn
  is kept as sampled.

Strict templates (``gemma3``, ``mistral``) accept only user and assistant turns, alternating
(a system message is folded into the first user turn), and raise on anything else. A tool
observation is then rendered as a user turn (``tool_messages``: ``user``, or ``auto`` when the
template refuses a ``tool`` message and accepts a ``user`` one); the conversation alternates.

``probe`` checks a template before a job starts: a short conversation of what the job's
environment sends (``ConversationNeeds``: a system prompt or not, user and/or tool
observations), rendered incrementally and whole, must be the same tokens; a message the template
refuses is named with the turn order that led to it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerFast

from flowrl.backends.models.model_folder import is_vision_language, load_tokenizer
from flowrl.backends.models.model_uri import resolve_model_uri
from flowrl.backends.models.tiny_model import IMAGE_TOKEN
from flowrl.environments.types import OBSERVATION_ROLES, TaskConfig


class ChatTemplateError(ValueError):
    """A model's chat template cannot be rendered one message at a time."""


@dataclass(frozen=True)
class ChatFamily:
    """What flowrl knows about one family of chat templates.

    ``markers``: strings that all appear in a template of the family (``auto`` detection, first
    match in ``FAMILIES`` order). ``end_of_turn``: the token the template writes after an
    assistant message; a template of the family that ends assistant turns otherwise is refused.
    ``thinking``: sampled turns may open with a ``<think>…</think>`` block that the environment
    does not see.
    """

    name: str
    markers: tuple[str, ...]
    end_of_turn: str | None
    thinking: bool = False


FAMILIES: tuple[ChatFamily, ...] = (
    ChatFamily("flowrl", ("<|assistant|>", "<|end|>"), "<|end|>"),
    ChatFamily("qwen3", ("<|im_start|>", "<think>"), "<|im_end|>", thinking=True),
    ChatFamily("chatml", ("<|im_start|>",), "<|im_end|>"),
    ChatFamily("llama3", ("<|start_header_id|>", "<|eot_id|>"), "<|eot_id|>"),
    ChatFamily("gemma3", ("<start_of_turn>", "<end_of_turn>"), "<end_of_turn>"),
    ChatFamily("mistral", ("[INST]", "[/INST]"), "</s>"),
)
"""The families docs/models.md names as supported. Any other template is ``template``: rendered the
same generic way, and accepted when ``probe`` finds it exact."""
GENERIC = ChatFamily("template", (), None)
CHAT_FORMATS = ("auto", *(f.name for f in FAMILIES), GENERIC.name)
TOOL_MESSAGES = ("auto", "tool", "user")
"""``model.tool_messages``: how a tool observation is written to the template: as a ``tool``
message, as a ``user`` turn, or ``auto`` (``user`` when the template refuses ``tool`` only)."""

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_BASE_REPLY = "flowrl base reply"
_BASE = ({"role": "user", "content": "flowrl base message"},)
PROBE_CONVERSATION: tuple[dict[str, str], ...] = (
    {"role": "system", "content": "You answer with the calculator."},
    {"role": "user", "content": "What is 12 + 30?"},
    {"role": "assistant", "content": "I will ask the calculator."},
    {"role": "tool", "content": "42"},
    {"role": "assistant", "content": "12 + 30 is 42."},
    {"role": "user", "content": "And 5 times 7?"},
)
"""The most ``probe`` renders: a system prompt, three user-side turns (one a tool result) and
two assistant turns. ``probe_conversation`` keeps what a job's environment sends of it."""


@dataclass(frozen=True)
class ConversationNeeds:
    """What a job's environment sends, so what its model's template must render."""

    system: bool = True
    """The environment has a system prompt."""
    observation_roles: tuple[str, ...] = OBSERVATION_ROLES
    """Roles of its observations (``"user"``, ``"tool"``); empty for a single-turn one."""


def conversation_needs(task: TaskConfig) -> ConversationNeeds:
    """What the environment of ``task`` sends: a system prompt (``get_system_prompt()`` after a
    reset on the first held-out row is non-empty) and the roles it declares as the class
    attribute ``observation_roles`` (undeclared: both). An environment that cannot be built or
    reset here (a game, a failing reset, which ``check_environment`` names) needs everything."""
    try:
        env = task.make_env()
        roles = tuple(getattr(env, "observation_roles", OBSERVATION_ROLES))
        rows = task.eval_set()[:1]
        env.reset(**(rows[0] if rows else {}))
        system = bool(env.get_system_prompt())
    except Exception:
        return ConversationNeeds()
    unknown = [r for r in roles if r not in OBSERVATION_ROLES]
    if unknown:
        raise ValueError(
            f"{type(env).__name__}.observation_roles names {unknown}: choose from "
            f"{OBSERVATION_ROLES}"
        )
    return ConversationNeeds(system=system, observation_roles=roles)


def probe_conversation(needs: ConversationNeeds) -> list[dict[str, str]]:
    """``PROBE_CONVERSATION`` without what the environment never sends: the system prompt, the
    tool result and the reply to it. The last user turn always stays: every conversation opens
    with one, and it shows what the template writes after an assistant turn."""
    system, user, reply, tool, answer, last = PROBE_CONVERSATION
    messages = [system] if needs.system else []
    messages += [user, reply]
    if "tool" in needs.observation_roles:
        messages += [tool, answer]
    return [*messages, last]


def detect_family(template: str) -> ChatFamily:
    """The first of ``FAMILIES`` whose markers all appear in ``template``, else ``GENERIC``."""
    for family in FAMILIES:
        if all(marker in template for marker in family.markers):
            return family
    return GENERIC


def family_named(name: str, template: str) -> ChatFamily:
    """``model.chat_format``: ``auto`` detects the family; a name picks it (``template``:
    generic)."""
    if name == "auto":
        return detect_family(template)
    for family in (*FAMILIES, GENERIC):
        if family.name == name:
            return family
    raise ValueError(f"unknown chat_format {name!r}; choose one of {CHAT_FORMATS}")


def generation_eos_ids(path: str) -> list[int]:
    """``eos_token_id`` of the folder's ``generation_config.json`` (an int or a list), else []."""
    file = Path(path) / "generation_config.json"
    if not file.is_file():
        return []
    eos = json.loads(file.read_text()).get("eos_token_id")
    if eos is None:
        return []
    return [int(t) for t in (eos if isinstance(eos, list) else [eos])]


_PROMPT_MEMO_SIZE = 4096


class HFChatFormat:
    """``ChatFormat`` over any Hugging Face chat template (see the module docstring).

    ``encode_prompt(opening) + sampled + closing(sampled) + encode_turn(m) + ...`` equals the
    token ids the template renders for the whole conversation (up to each family's documented
    difference). ``stop_token_ids``: the template's end-of-turn token first, then every other
    ``eos_token_id`` of ``generation_config.json`` and the tokenizer's eos.

    With ``sanitize_control_tokens=True`` control tokens inside message text (an environment
    printing ``<|im_end|>``) are encoded as plain characters.

    Images (vision-language models, ``image_seq_length > 0``): a message's content may be a list
    of parts ``{"type": "image"}`` / ``{"type": "text", "text": ...}``; the template renders each
    image part as one ``IMAGE_TOKEN``, which is then repeated ``image_seq_length`` times, so the
    ids are exactly the sequence the model consumes.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        sanitize_control_tokens: bool = False,
        image_seq_length: int = 0,
        chat_format: str = "auto",
        eos_token_ids: list[int] | tuple[int, ...] = (),
        name: str = "the model",
        tool_messages: str = "auto",
    ):
        if not tokenizer.chat_template:
            raise ChatTemplateError(f"{name}: the tokenizer has no chat template")
        self.tokenizer = tokenizer
        self.name = name
        self.family = family_named(chat_format, tokenizer.chat_template)
        self.image_seq_length = image_seq_length
        self.image_token_id: int | None = None
        if image_seq_length > 0:
            image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
            if image_id is None or image_id == tokenizer.unk_token_id:
                raise ValueError(f"image_seq_length is set but the tokenizer has no {IMAGE_TOKEN}")
            self.image_token_id = int(image_id)
        # Only pass the flag when set: older transformers releases do not know it.
        self._template_kwargs = {"sanitize_control_tokens": True} if sanitize_control_tokens else {}
        self._sanitize = sanitize_control_tokens
        specials = sorted(
            (t.content for t in tokenizer.added_tokens_decoder.values() if t.special),
            key=len,
            reverse=True,
        )
        self._control = re.compile(
            "(" + "|".join(map(re.escape, specials)) + ")" if specials else "(?!)"
        )
        self.end_of_turn = self._end_of_turn_token()
        self.tool_role = self._tool_role(tool_messages)
        """The role a tool observation is rendered with: ``"tool"`` or ``"user"``."""
        self.end_of_turn_id = int(tokenizer.convert_tokens_to_ids(self.end_of_turn))
        stops = [self.end_of_turn_id, *eos_token_ids]
        if tokenizer.eos_token_id is not None:
            stops.append(int(tokenizer.eos_token_id))
        self.stop_token_ids: list[int] = list(dict.fromkeys(stops))
        self._prompts: dict[str, list[int]] = {}  # encode_prompt's memo (text-only prompts)
        self.source: ChatSource | None = None
        """What it was built from (``chat_format_of``), for another process to build it too."""

    @classmethod
    def from_folder(
        cls,
        path: str,
        chat_format: str = "auto",
        sanitize_control_tokens: bool = True,
        tool_messages: str = "auto",
    ) -> HFChatFormat:
        """The format of a local model folder: its tokenizer, template and generation config."""
        images = 0
        if is_vision_language(path):  # vlm builds on backends.models.tiny_model, and imports torch
            from flowrl.backends.models.vlm import image_seq_length

            images = image_seq_length(path)
        return cls(
            load_tokenizer(path),
            sanitize_control_tokens=sanitize_control_tokens,
            image_seq_length=images,
            chat_format=chat_format,
            eos_token_ids=generation_eos_ids(path),
            name=f"model folder {path}",
            tool_messages=tool_messages,
        )

    # ------------------------------------------------------------------ the ChatFormat protocol

    def encode_prompt(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Opening messages plus the generation prompt, as token ids (BOS, default system
        message and all, exactly as the template renders them). ``tools``: function
        definitions the template renders (OpenAI's shape; the endpoint's tool calls).
        Text-only prompts are remembered (a GRPO group's episodes open with the same
        messages)."""
        try:
            key = json.dumps([messages, tools], sort_keys=True)
        except TypeError:  # image bytes: rendered every time
            return self._expand(self._render_ids(messages, True, tools))
        ids = self._prompts.get(key)
        if ids is None:
            if len(self._prompts) >= _PROMPT_MEMO_SIZE:
                self._prompts.clear()
            ids = self._prompts[key] = self._expand(self._render_ids(messages, True, tools))
        return list(ids)

    def encode_turn(self, message: dict[str, Any]) -> list[int]:
        """What follows a sampled turn's end-of-turn token: the template's separator, ``message``
        (user or tool) and the generation prompt."""
        return self.encode_turns([message])

    def encode_turns(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """``encode_turn`` for several messages at once: rendered together, as the template
        groups them (Qwen writes consecutive tool results into one user turn), with one
        generation prompt after the last. ``tools``: the conversation's tool definitions."""
        conversation = [*_BASE, {"role": "assistant", "content": _BASE_REPLY}, *messages]
        role = messages[0].get("role") if messages else None
        text = self._render_text(conversation, generation_prompt=True, tools=tools)
        start = text.index(_BASE_REPLY) + len(_BASE_REPLY)
        if not text.startswith(self.end_of_turn, start):
            raise ChatTemplateError(
                f"{self.name}: the template does not end an assistant turn with "
                f"{self.end_of_turn!r} when a {role!r} message follows"
            )
        base = self._encode_text(text[: start + len(self.end_of_turn)])
        ids = self._render_ids(conversation, generation_prompt=True, tools=tools)
        if ids[: len(base)] != base:
            raise ChatTemplateError(
                f"{self.name}: the template renders the conversation before a new "
                f"{role!r} message differently once it is added"
            )
        return self._expand(ids[len(base) :])

    def closing(self, sampled: list[int]) -> list[int]:
        """Injected (mask 0) after a sampled turn that did not end with the template's
        end-of-turn token (cut by the length budget, or stopped on another eos id)."""
        return [] if sampled[-1:] == [self.end_of_turn_id] else [self.end_of_turn_id]

    def decode(self, tokens: list[int]) -> str:
        """Text of ``tokens`` without special tokens (a stop token is dropped)."""
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def response(self, text: str) -> str:
        """What the environment sees of a sampled turn: for a thinking family the text after
        the last ``</think>``, else the whole text."""
        if self.family.thinking and THINK_CLOSE in text:
            return text.rsplit(THINK_CLOSE, 1)[1].lstrip("\n")
        return text

    def encode_reply(self, content: str) -> list[int]:
        """An assistant message's content as the sampler would emit it, end-of-turn included
        (SFT targets; no BOS). Sanitized, a special token written inside the content (an SFT
        row holding ``<|im_end|><|im_start|>user``) is encoded as characters, as in
        observations, so data can never inject control tokens with loss mask 1."""
        if not self._sanitize:
            return self._encode_text(content) + [self.end_of_turn_id]
        ids: list[int] = []
        for i, piece in enumerate(self._control.split(content)):
            if i % 2 == 0:
                ids += self._encode_text(piece)
            else:  # split so that neither half is the control token itself
                ids += self._encode_text(piece[:1]) + self._encode_text(piece[1:])
        return ids + [self.end_of_turn_id]

    def template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``messages`` as the template is given them: tool messages as ``tool_role``."""
        if self.tool_role == "tool":
            return messages
        return [{**m, "role": self.tool_role} if m.get("role") == "tool" else m for m in messages]

    def refusal(self, messages: list[dict[str, Any]]) -> str | None:
        """Why the template refuses to render ``messages`` (as ``template_messages``), naming the
        first message it refuses and the turn order before it; None when it renders them."""
        messages = self.template_messages(messages)
        for end in range(1, len(messages) + 1):
            try:
                self._raw_text(messages[:end], generation_prompt=False)
            except TemplateError as exc:
                order = " -> ".join(m.get("role", "?") for m in messages[:end])
                return (
                    f"a {messages[end - 1].get('role')!r} message (turn order {order}): "
                    f"the template raises {str(exc)!r}"
                )
        return None

    # ------------------------------------------------------------------------------ internals

    def _tool_role(self, mode: str) -> str:
        if mode not in TOOL_MESSAGES:
            raise ValueError(f"unknown tool_messages {mode!r}; choose one of {TOOL_MESSAGES}")
        if mode != "auto":
            return mode
        after_reply = [*_BASE, {"role": "assistant", "content": _BASE_REPLY}]
        for role in ("tool", "user"):
            try:
                self._raw_text([*after_reply, {"role": role, "content": "42"}], True)
                return role
            except TemplateError:
                continue
        return "tool"  # refuses both: the probe names it

    def _end_of_turn_token(self) -> str:
        conversation = [*_BASE, {"role": "assistant", "content": _BASE_REPLY}]
        text = self._raw_text(conversation, generation_prompt=False)
        after = text[text.index(_BASE_REPLY) + len(_BASE_REPLY) :]
        added = sorted(self.tokenizer.get_added_vocab(), key=len, reverse=True)
        found = next((t for t in added if after.startswith(t)), None)
        if found is None:
            raise ChatTemplateError(
                f"{self.name}: the template writes no special end-of-turn token after an "
                f"assistant message (it writes {after[:20]!r}); flowrl cannot tell where a "
                "sampled turn ends"
            )
        expected = self.family.end_of_turn
        if expected is not None and found != expected:
            raise ChatTemplateError(
                f"{self.name}: chat_format {self.family.name!r} ends an assistant turn with "
                f"{expected!r}, but this template writes {found!r}; set model.chat_format: auto"
            )
        return found

    def _render_text(
        self,
        messages: list[dict[str, Any]],
        generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return self._raw_text(self.template_messages(messages), generation_prompt, tools)

    def _raw_text(
        self,
        messages: list[dict[str, Any]],
        generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False
        )

    def _render_ids(
        self,
        messages: list[dict[str, Any]],
        generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[int]:
        has_parts = any(isinstance(m.get("content"), list) for m in messages)
        if has_parts and self.image_token_id is None:
            raise ValueError(
                "a message carries content parts (images) but this model reads text only; "
                "use a vision-language model (model.tiny.vision.enabled)"
            )
        encoded = self.tokenizer.apply_chat_template(
            self.template_messages(messages),
            tools=tools,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=False,
            **self._template_kwargs,
        )
        # transformers 5 returns a BatchEncoding by default; be robust to either shape.
        if isinstance(encoded, Mapping):
            encoded = encoded["input_ids"]
        return [int(t) for t in encoded]

    def _encode_text(self, text: str) -> list[int]:
        return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]

    def _expand(self, ids: list[int]) -> list[int]:
        if self.image_token_id is None:
            return ids
        image, n = self.image_token_id, self.image_seq_length
        return [u for t in ids for u in ([t] * n if t == image else [t])]


def probe(chat: HFChatFormat, needs: ConversationNeeds | None = None) -> None:
    """Refuse a template that flowrl cannot render one message at a time: render
    ``probe_conversation(needs)`` incrementally (as the agent loop does) and whole; any
    difference raises ``ChatTemplateError`` naming the model and showing the first differing
    position, decoded on both sides. A message of it that the template refuses raises naming
    the message's role and the turn order. Without ``needs`` (the environment unknown) the
    probe renders what the template accepts of ``PROBE_CONVERSATION``."""
    if needs is None:
        needs = _accepted(chat)
    messages = probe_conversation(needs)
    refused = chat.refusal(messages)
    if refused is not None:
        raise ChatTemplateError(
            f"{chat.name}: its chat template refuses {refused}. The job's environment sends "
            f"{_described(needs)}{_hint(chat, needs)}"
        )
    first_reply = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    incremental = chat.encode_prompt(messages[:first_reply])
    for message in messages[first_reply:]:
        if message["role"] == "assistant":
            incremental += chat.encode_reply(message["content"])
        else:
            incremental += chat.encode_turn(message)
    whole = chat.encode_prompt(messages)
    if incremental == whole:
        return
    at = next(
        (i for i, (a, b) in enumerate(zip(incremental, whole, strict=False)) if a != b),
        min(len(incremental), len(whole)),
    )

    def around(ids: list[int]) -> str:
        return repr(chat.tokenizer.decode(ids[max(0, at - 8) : at + 8]))

    raise ChatTemplateError(
        f"{chat.name}: its chat template cannot be rendered one message at a time "
        f"(chat_format {chat.family.name!r}); rendered incrementally and whole, a "
        f"{len(messages)}-message conversation first differs at token {at}: "
        f"incremental {around(incremental)}, whole {around(whole)}. flowrl trains on the "
        "incremental tokens, so the model would see a conversation its template never writes"
    )


def _accepted(chat: HFChatFormat) -> ConversationNeeds:
    """The most of ``PROBE_CONVERSATION`` the template renders: the system prompt and each
    observation role, where it accepts them."""
    system = chat.refusal(list(PROBE_CONVERSATION[:2])) is None
    opening = list(PROBE_CONVERSATION[1:3])
    roles = tuple(
        r
        for r in OBSERVATION_ROLES
        if chat.refusal([*opening, {"role": r, "content": "42"}]) is None
    )
    return ConversationNeeds(system=system, observation_roles=roles)


def _described(needs: ConversationNeeds) -> str:
    system = "a system prompt" if needs.system else "no system prompt"
    roles = " and ".join(f"{r!r}" for r in needs.observation_roles) or "no"
    return f"{system}, a first user turn, then {roles} observations after the model's turns"


def _hint(chat: HFChatFormat, needs: ConversationNeeds) -> str:
    """How to make the job renderable, where flowrl knows one."""
    if "tool" in needs.observation_roles and chat.tool_role == "tool":
        after_reply = list(PROBE_CONVERSATION[1:3])
        if chat.refusal([*after_reply, {"role": "tool", "content": "42"}]) is not None:
            return "; set model.tool_messages: user to send tool results as user turns"
    return ""


def check_chat_template(
    uri: str,
    chat_format: str = "auto",
    tool_messages: str = "auto",
    task: TaskConfig | None = None,
) -> None:
    """Before a job starts: ``probe`` the chat template of a local ``model.source`` folder with
    what the environment of ``task`` sends (unknown: everything; ``tiny`` is flowrl's own
    format; a remote or registry source is probed where the job fetches it). Raises
    ``ChatTemplateError`` naming the folder and the refused message or first difference."""
    if uri == "tiny" or ("://" in uri and not uri.startswith("file://")):
        return
    folder = resolve_model_uri(uri, cache_dir="")
    chat = HFChatFormat.from_folder(folder, chat_format, tool_messages=tool_messages)
    probe(chat, conversation_needs(task) if task is not None else ConversationNeeds())


@dataclass(frozen=True)
class ChatSource:
    """What a job's chat format is built from (``chat_format_of``): small data, so that
    another process (the policy's worker, ``backends.engines.episodes``) builds the same format."""

    model_uri: str
    cache_dir: str
    chat_format: str = "auto"
    tool_messages: str = "auto"


@lru_cache(maxsize=8)
def chat_format_of(source: ChatSource) -> HFChatFormat:
    """The chat format ``source`` names: tokenizer, template, generation config and processor
    settings of its model (never the weights), checked by ``probe`` the first time a process
    asks for it, and remembered. Control tokens inside environment text stay text."""
    folder = resolve_model_uri(source.model_uri, source.cache_dir)
    chat = HFChatFormat.from_folder(
        folder, chat_format=source.chat_format, tool_messages=source.tool_messages
    )
    probe(chat)
    chat.source = source
    return chat
