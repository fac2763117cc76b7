"""Tool calls in the OpenAI-compatible endpoint: a request's ``tools``, the messages that carry
tool calls, and the tool calls of a sampled answer, in each chat family's own syntax.

A request's function definitions go to the model's chat template (``tools=``), which writes them
as the family does; an assistant message's ``tool_calls`` and a ``tool`` message (its
``tool_call_id``) are rendered by the template too. A sampled answer is parsed back
(``parse_tool_calls``) into OpenAI's ``tool_calls``, by family (``PARSERS``):

- ``qwen3``, ``chatml`` (Hermes style): one or more blocks
  ``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``; the text outside the blocks
  is the message's content (null when empty);
- ``llama3`` (3.1 JSON tool calling): the whole answer is one JSON object
  ``{"name": …, "parameters": {…}}`` (3.1 calls one tool per turn); the content is null.

The other families (``flowrl``, ``gemma3``, ``mistral``, ``template``) cannot express tools: a
request with tools or tool calls gets a 400 saying so (``check_expressible``), as does a
template of a tool family that does not render them (a plain ChatML template): tools are never
dropped silently.

The answer is model output, so hostile text: it is read with ``json.loads`` only (never
evaluated), and parsing never raises. It is all or nothing: an answer whose calls are not all
well formed (malformed or truncated JSON, an unclosed block, a stray close tag, a name that is not
one of the request's tools, arguments that are not an object, NaN or infinities, more than
``MAX_CALLS`` calls, text over ``MAX_PARSED_CHARS``) is left whole as the message's content,
with no ``tool_calls``: the agent sees what the model wrote, and its echo of that text still
continues the session token-exactly.

``tool_choice``: ``auto`` (the default) or ``none`` (the definitions are still rendered, so every
turn of a conversation sees the same prompt, and the answer is never parsed into tool calls);
``required`` or a named function would need constrained decoding: 400. ``parallel_tool_calls:
false`` cannot be enforced on a Hermes family: 400.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from flowrl.infra.serving import ServiceError

MAX_TOOLS = 128
"""Function definitions per request."""
MAX_CALLS = 64
"""Tool calls per message (a request's or an answer's)."""
MAX_PARSED_CHARS = 200_000
"""An answer longer than this is not parsed for tool calls (left as content)."""
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""OpenAI's function names (the template writes the name inside a JSON string)."""
_FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"

_PROBE_TOOL = {"type": "function", "function": {"name": "flowrl_probe_tool", "parameters": {}}}
_PROBE_CALL = {"name": "flowrl_probe_call", "arguments": {}}
_PROBE = [
    {"role": "user", "content": "flowrl probe"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": "call_probe", "type": "function", "function": _PROBE_CALL}],
    },
    {"role": "tool", "content": "42", "tool_call_id": "call_probe"},
]
"""A conversation with a tool definition and a tool call: a template that expresses tools
writes both names."""
_RENDERS: dict[tuple[str, str], str | None] = {}
"""``tool_support``'s memo: (family, template) -> why not, or None."""

ParsedCall = tuple[str, dict[str, Any]]
"""A parsed tool call: the function's name and its arguments."""


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools: the function definitions the template renders (empty: none) and
    whether the answer is parsed for tool calls (``tool_choice`` not ``none``)."""

    definitions: list[dict[str, Any]] = field(default_factory=list)
    parse: bool = False

    @property
    def names(self) -> set[str]:
        return {d["function"]["name"] for d in self.definitions}

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template is given as ``tools`` (None without definitions)."""
        return self.definitions or None


# ------------------------------------------------------------------------- requests


def tool_request(body: dict[str, Any]) -> ToolRequest:
    """The request's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked: a 400
    naming the first field that is malformed or that the endpoint cannot honour."""
    definitions = _definitions(body.get("tools"))
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise ServiceError(
            400,
            "tool_choice: only 'auto' or 'none' (forcing a call would need constrained decoding)",
        )
    if body.get("parallel_tool_calls") not in (None, True):
        raise ServiceError(
            400, "parallel_tool_calls: only true (a model may write several calls in one turn)"
        )
    return ToolRequest(definitions, parse=bool(definitions) and choice != "none")


def _definitions(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ServiceError(400, f"tools: a list of up to {MAX_TOOLS} function tools")
    out, seen = [], set()
    for i, tool in enumerate(tools):
        out.append(_definition(tool, f"tools[{i}]"))
        name = out[-1]["function"]["name"]
        if name in seen:
            raise ServiceError(400, f"tools[{i}].function.name: {name!r} is defined twice")
        seen.add(name)
    return out


def _definition(tool: Any, where: str) -> dict[str, Any]:
    """One function tool, as the template is given it: ``{"type": "function", "function":
    {name, description?, parameters?}}``."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise ServiceError(400, f"{where}.type: only 'function' tools are supported")
    unknown = sorted(set(tool) - {"type", "function"})
    if unknown:
        raise ServiceError(400, f"{where}.{unknown[0][:40]}: unknown field")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ServiceError(400, f"{where}.function: an object with a name")
    unknown = sorted(set(function) - _FUNCTION_FIELDS)
    if unknown:
        raise ServiceError(400, f"{where}.function.{unknown[0][:40]}: unknown field")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ServiceError(400, f"{where}.function.name: 1 to 64 of a-z, A-Z, 0-9, _ and -")
    out: dict[str, Any] = {"name": name}
    if function.get("description") is not None:
        if not isinstance(function["description"], str):
            raise ServiceError(400, f"{where}.function.description: a string")
        out["description"] = function["description"]
    if function.get("parameters") is not None:
        if not isinstance(function["parameters"], dict):
            raise ServiceError(400, f"{where}.function.parameters: a JSON Schema object")
        out["parameters"] = function["parameters"]
    if function.get("strict"):
        raise ServiceError(
            400, f"{where}.function.strict: not supported (arguments are not constrained)"
        )
    return {"type": "function", "function": out}


def request_tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as ``[{"id", "type": "function", "function":
    {"name", "arguments"}}]`` (``arguments`` the JSON string the client sent, unchanged);
    400 naming the first malformed field. None or empty: ``[]``."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_CALLS:
        raise ServiceError(400, f"{where}: a list of up to {MAX_CALLS} tool calls")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise ServiceError(400, f"{at}.type: only 'function' tool calls")
        function = call.get("function")
        if not isinstance(call.get("id"), str) or not isinstance(function, dict):
            raise ServiceError(400, f"{at}: an id and a function")
        name, arguments = function.get("name"), function.get("arguments")
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise ServiceError(400, f"{at}.function: a name and its arguments as a JSON string")
        calls.append(_call_message(call["id"], name, arguments))
    return calls


def check_expressible(chat: Any, tools: ToolRequest, messages: list[dict[str, Any]]) -> None:
    """400 when the request uses tools (definitions, or messages with tool calls) and the model's
    chat format cannot express them."""
    if not tools.definitions and not any(m.get("tool_calls") for m in messages):
        return
    why = tool_support(chat)
    if why is not None:
        raise ServiceError(400, f"tools: {why}")


def for_template(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as a chat template reads them: a tool call's ``arguments`` as the object the
    JSON string holds (templates write it with ``tojson``, as vLLM gives it them; a string that
    is not a JSON object stays a string)."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [
                {**c, "function": {**c["function"], "arguments": _object(c)}}
                for c in message["tool_calls"]
            ]
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


def _object(call: dict[str, Any]) -> Any:
    text = call["function"]["arguments"]
    parsed = _json(text)
    return parsed if isinstance(parsed, dict) else text


# ------------------------------------------------------------------------- families


def tool_support(chat: Any) -> str | None:
    """Why ``chat`` cannot express tools (its family has no tool syntax here, or its template
    does not render definitions and calls); None when it can. Checked once per template."""
    family = getattr(getattr(chat, "family", None), "name", None)
    if family not in PARSERS:
        return (
            f"the model's chat format ({family or 'unknown'!r}) cannot express tool calls "
            f"(the families that can: {', '.join(sorted(PARSERS))})"
        )
    key = (family, chat.tokenizer.chat_template)
    if key not in _RENDERS:
        _RENDERS[key] = _renders_tools(chat)
    return _RENDERS[key]


def _renders_tools(chat: Any) -> str | None:
    try:
        text = chat.tokenizer.apply_chat_template(
            chat.template_messages(_PROBE), tools=[_PROBE_TOOL], tokenize=False
        )
    except Exception as err:  # noqa: BLE001 - any failure of the template is its answer
        return f"the model's chat template fails on tools ({str(err)[:120]})"
    missing = [n for n in ("flowrl_probe_tool", "flowrl_probe_call") if n not in text]
    if missing:
        what = "definitions" if "flowrl_probe_tool" in missing else "calls"
        return f"the model's chat template does not render tool {what}"
    return None


def parse_tool_calls(
    family: str, text: str, names: set[str]
) -> tuple[str | None, list[dict[str, Any]]] | None:
    """``text``'s tool calls in ``family``'s syntax as (content, OpenAI ``tool_calls``); None
    when it has none, or not all well formed (see the module docstring). Never raises."""
    parser = PARSERS.get(family)
    if parser is None or len(text) > MAX_PARSED_CHARS:
        return None
    parsed = parser(text)
    if parsed is None:
        return None
    content, calls = parsed
    if not calls or len(calls) > MAX_CALLS or any(name not in names for name, _ in calls):
        return None
    messages = []
    for name, arguments in calls:
        try:
            encoded = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (ValueError, RecursionError):
            return None
        messages.append(_call_message(f"call_{secrets.token_hex(12)}", name, encoded))
    return (content.strip() or None), messages


def answer_message(chat: Any, text: str, tools: ToolRequest) -> dict[str, Any]:
    """A sampled answer as a chat message: what the agent sees of ``text``
    (``chat.response``), with its tool calls when the request has tools to call."""
    content = chat.response(text)
    parsed = parse_tool_calls(chat.family.name, content, tools.names) if tools.parse else None
    if parsed is None:
        return {"role": "assistant", "content": content}
    rest, calls = parsed
    return {"role": "assistant", "content": rest, "tool_calls": calls}


def echoed(answer: dict[str, Any]) -> dict[str, Any]:
    """``answer`` as ``routes.request_messages`` reads the agent's echo of it (a null content
    is ``""``), for comparing the two."""
    out = {"role": "assistant", "content": answer.get("content") or ""}
    if answer.get("tool_calls"):
        out["tool_calls"] = answer["tool_calls"]
    return out


def _call_message(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _hermes(text: str) -> tuple[str, list[ParsedCall]] | None:
    """``<tool_call>`` blocks (Qwen, Hermes): scanned with ``find`` (linear in the text)."""
    outside, calls, at = [], [], 0
    while (start := text.find(HERMES_OPEN, at)) >= 0:
        end = text.find(HERMES_CLOSE, start)
        if end < 0:
            return None  # unclosed (cut by the length budget): not a call
        call = _call(text[start + len(HERMES_OPEN) : end], "arguments")
        if call is None:
            return None
        outside.append(text[at:start])
        calls.append(call)
        at = end + len(HERMES_CLOSE)
    outside.append(text[at:])
    content = "".join(outside)
    if not calls or HERMES_CLOSE in content:
        return None
    return content, calls


def _llama3_json(text: str) -> tuple[str, list[ParsedCall]] | None:
    """Llama 3.1's JSON tool call: the answer is one object ``{"name", "parameters"}``
    (``<|python_tag|>`` before it is a special token, so not in the decoded text)."""
    body = text.strip()
    if not body.startswith("{"):
        return None
    call = _call(body, "parameters")
    return None if call is None else ("", [call])


def _call(body: str, arguments_key: str) -> ParsedCall | None:
    """``{"name": str, arguments_key: object}`` (arguments may be left out: none), nothing else."""
    obj = _json(body)
    if not isinstance(obj, dict) or set(obj) - {"name", arguments_key}:
        return None
    name, arguments = obj.get("name"), obj.get(arguments_key, {})
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return None
    return name, arguments


def _json(text: str) -> Any:
    """``json.loads`` of untrusted text; None when it is not JSON (NaN and infinities are not;
    nesting too deep for the parser and integers too long for Python are not either)."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError):
        return None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


PARSERS: dict[str, Callable[[str], tuple[str, list[ParsedCall]] | None]] = {
    "qwen3": _hermes,
    "chatml": _hermes,
    "llama3": _llama3_json,
}
"""The families whose tool-call syntax is parsed, by ``backends.models.chat.ChatFamily`` name."""
