"""The OpenAI-compatible endpoint's routes (``service.OpenAIService`` holds the state):

- ``GET /v1/models``, ``GET /v1/models/{id}``;
- ``POST /v1/chat/completions``: messages rendered by the model's chat template, streaming
  (server-sent events, ``data: [DONE]`` last) or not; with ``tools``, the answer's tool calls
  in the family's syntax become ``tool_calls`` (``tools.py``; streamed in one delta with the
  content, as the completion is sampled whole first);
- ``POST /v1/completions``: a text prompt (or token ids) continued as it is, no template.

Behind the serving layer's guard (``infra.serving.guarded_app``): keys (``Authorization:
Bearer``, as the ``openai`` client sends them) map to namespaces, body size and request-rate
limits; a malformed body is a 422 naming the field, a parameter the engine cannot honour a 400
naming it. Besides the standard fields, a completion carries its token ids (``token_ids``, and
``prompt_token_ids`` on the response): the ids as sampled, which the text is decoded from.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from flowrl.backends.services.openai_api.service import (
    Completion,
    OpenAIService,
    Served,
    check_parameters,
)
from flowrl.backends.services.openai_api.tools import (
    ToolRequest,
    answer_message,
    check_expressible,
    for_template,
    request_tool_calls,
    tool_request,
)
from flowrl.infra.serving import ServiceError, guarded_app

_ROLES = ("system", "developer", "user", "assistant", "tool")


def create_app(service: OpenAIService) -> FastAPI:
    """The endpoint's FastAPI app."""
    app = guarded_app(
        "flowrl OpenAI-compatible API", service.keys, service.limits, open_paths=("/health",)
    )

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    def models(request: Request) -> dict[str, Any]:
        return {"object": "list", "data": service.list_models(request.state.namespace)}

    @app.get("/v1/models/{model_id:path}")
    def model(request: Request, model_id: str) -> dict[str, Any]:
        for entry in service.list_models(request.state.namespace):
            if entry["id"] == model_id:
                return entry
        raise ServiceError(404, f"no model {model_id[:120]!r}")

    async def answer(request: Request, work: Any, stream: Any) -> Any:
        """``work(service, namespace, body)`` in a worker thread (loading and sampling block);
        its answer as JSON, or as server-sent events with ``stream``."""
        body = await json_object(request)
        result = await run_in_threadpool(work, service, request.state.namespace, body)
        if body.get("stream"):
            return StreamingResponse(stream(result), media_type="text/event-stream")
        return result

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Any:
        return await answer(request, _chat, _chat_stream)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Any:
        return await answer(request, _complete, _text_stream)

    return app


# ------------------------------------------------------------------------- requests


async def json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object, or a 422 naming why not. Besides text that is not JSON:
    nesting deeper than the parser's recursion (``[[[…`` raises ``RecursionError``), and a
    ``\\ud800``-style escape of a lone surrogate, valid JSON but no text: neither a tokenizer
    nor a JSON answer quoting it can encode it (both were 500s, and uvicorn then dropped the
    connection)."""
    try:
        body = await request.json()
    except ValueError:
        raise ServiceError(422, "malformed request: the body is not JSON") from None
    except RecursionError:
        raise ServiceError(422, "malformed request: the body is nested too deeply") from None
    if not isinstance(body, dict):
        raise ServiceError(422, "malformed request: the body is not a JSON object")
    if _LONE_SURROGATE_ESCAPE.search(await request.body()) and not _is_text(body):
        raise ServiceError(
            422, "malformed request: a string holds a lone surrogate (\\ud800-\\udfff)"
        )
    return body


_LONE_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""The only way a lone surrogate gets into a parsed body (raw bytes must be valid UTF-8); a
paired one (an escaped emoji) matches too and is checked by ``_is_text``."""


def _is_text(value: Any) -> bool:
    """Whether every string in a parsed JSON value (keys too) encodes as UTF-8; iterative, as
    the value may be nested as deep as the parser went."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo += [*item.keys(), *item.values()]
        elif isinstance(item, list):
            todo += item
        elif isinstance(item, str) and not item.isascii():
            try:
                item.encode()
            except UnicodeEncodeError:
                return False
    return True


def _chat(service: OpenAIService, namespace: str | None, body: dict[str, Any]) -> dict[str, Any]:
    """A chat completion (in a worker thread: loading and sampling block)."""
    check_parameters(body)
    tools = tool_request(body)
    served = service.model(namespace, body.get("model"))
    messages = request_messages(body.get("messages"))
    check_expressible(served.chat, tools, messages)
    prompt = _chat_prompt(served, messages, tools)
    completions = service.sample(served, prompt, body)
    answers = [answer_message(served.chat, c.text, tools) for c in completions]
    return chat_answer(served, prompt, completions, answers, bool(body.get("logprobs")))


def _complete(
    service: OpenAIService, namespace: str | None, body: dict[str, Any]
) -> dict[str, Any]:
    """A text completion (in a worker thread)."""
    check_parameters(body)
    for name in ("tools", "tool_choice"):
        if body.get(name) is not None:
            raise ServiceError(400, f"{name}: chat completions only (/v1/chat/completions)")
    served = service.model(namespace, body.get("model"))
    prompt = _text_prompt(served, body.get("prompt"))
    sampled = service.sample(served, prompt, body)
    return _text_answer(served, prompt, sampled, bool(body.get("logprobs")))


def request_messages(messages: Any) -> list[dict[str, Any]]:
    """A request's messages as ``{"role", "content"}`` with text content (``developer`` is a
    system message); an assistant message's ``tool_calls`` kept (its content may then be null:
    ``""``), a tool message's ``tool_call_id`` too. 400 naming the first message that is not
    one."""
    if not isinstance(messages, list) or not messages or len(messages) > 256:
        raise ServiceError(400, "messages: a list of 1 to 256 messages")
    return [_message(message, i) for i, message in enumerate(messages)]


def _message(message: Any, i: int) -> dict[str, Any]:
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise ServiceError(400, f"messages[{i}]: role one of {', '.join(_ROLES)}")
    role = "system" if message["role"] == "developer" else message["role"]
    calls = request_tool_calls(message.get("tool_calls"), f"messages[{i}].tool_calls")
    if calls and role != "assistant":
        raise ServiceError(400, f"messages[{i}].tool_calls: on assistant messages only")
    content = message.get("content")
    text = "" if calls and content is None else _text(content, i)
    out: dict[str, Any] = {"role": role, "content": text}
    if calls:
        out["tool_calls"] = calls
    call_id = message.get("tool_call_id")
    if role == "tool" and call_id is not None:
        if not isinstance(call_id, str):
            raise ServiceError(400, f"messages[{i}].tool_call_id: a string")
        out["tool_call_id"] = call_id
    return out


def _chat_prompt(served: Served, messages: list[dict[str, Any]], tools: ToolRequest) -> list[int]:
    """The messages as the model's chat template renders them (with the request's tool
    definitions), generation prompt included."""
    from jinja2 import TemplateError

    from flowrl.backends.models.chat import ChatTemplateError

    rendered = for_template(messages)
    try:
        return served.chat.encode_prompt(rendered, tools.template_tools)
    except (ChatTemplateError, TemplateError) as err:
        why = served.chat.refusal(rendered) or str(err)
        raise ServiceError(400, f"messages: {why}"[:300]) from None


def _text(content: Any, index: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
        for p in content
    ):
        return "".join(p["text"] for p in content)
    raise ServiceError(400, f"messages[{index}].content: text, or a list of text parts")


def _text_prompt(served: Served, prompt: Any) -> list[int]:
    if isinstance(prompt, str) and prompt:
        return served.chat.tokenizer.encode(prompt, add_special_tokens=False)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return list(prompt)
    raise ServiceError(400, "prompt: a non-empty string, or a list of token ids")


# ------------------------------------------------------------------------- answers


def _logprobs(served: Served, c: Completion) -> dict[str, Any]:
    pieces = [served.chat.tokenizer.decode([t]) for t in c.tokens]
    return {
        "content": [
            {"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []}
            for p, lp in zip(pieces, c.logprobs, strict=True)
        ]
    }


def _usage(prompt: list[int], completions: list[Completion]) -> dict[str, int]:
    sampled = sum(len(c.tokens) for c in completions)
    return {
        "prompt_tokens": len(prompt),
        "completion_tokens": sampled,
        "total_tokens": len(prompt) + sampled,
    }


def chat_answer(
    served: Any,
    prompt: list[int],
    completions: list[Completion],
    answers: list[dict[str, Any]],
    logprobs: bool,
) -> dict[str, Any]:
    """A chat completion: per completion its answer message (``tools.answer_message``), its
    ``finish_reason`` ("tool_calls" when the answer calls tools and ended by itself) and its
    sampled ``token_ids``."""
    choices = []
    for i, (c, message) in enumerate(zip(completions, answers, strict=True)):
        calls = c.finish_reason == "stop" and message.get("tool_calls")
        choice: dict[str, Any] = {
            "index": i,
            "message": message,
            "finish_reason": "tool_calls" if calls else c.finish_reason,
            "logprobs": _logprobs(served, c) if logprobs else None,
            "token_ids": c.tokens,
        }
        choices.append(choice)
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": served.name,
        "system_fingerprint": served.fingerprint,
        "choices": choices,
        "usage": _usage(prompt, completions),
        "prompt_token_ids": prompt,
    }


def _text_answer(
    served: Served, prompt: list[int], completions: list[Completion], logprobs: bool
) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(completions):
        lp = None
        if logprobs:
            tokens = [served.chat.tokenizer.decode([t]) for t in c.tokens]
            lp = {"tokens": tokens, "token_logprobs": c.logprobs, "top_logprobs": None}
        choices.append(
            {
                "index": i,
                "text": c.text,
                "finish_reason": c.finish_reason,
                "logprobs": lp,
                "token_ids": c.tokens,
            }
        )
    return {
        "id": f"cmpl-{secrets.token_hex(12)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": served.name,
        "system_fingerprint": served.fingerprint,
        "choices": choices,
        "usage": _usage(prompt, completions),
        "prompt_token_ids": prompt,
    }


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _chat_stream(answer: dict[str, Any]) -> Iterator[str]:
    """The answer as chat completion chunks: per choice its role, its content and tool calls
    (one delta) and its end (the completion is sampled whole, then sent)."""
    keys = ("id", "created", "model", "system_fingerprint")
    head = {k: answer[k] for k in keys} | {"object": "chat.completion.chunk"}
    for choice in answer["choices"]:
        i = choice["index"]
        message = choice["message"]
        yield _event(head | {"choices": [{"index": i, "delta": {"role": "assistant"}}]})
        content: dict[str, Any] = {"content": message["content"]}
        if message.get("tool_calls"):
            content["tool_calls"] = [
                {"index": j, **call} for j, call in enumerate(message["tool_calls"])
            ]
        delta = {"index": i, "delta": content, "token_ids": choice["token_ids"]}
        if choice["logprobs"] is not None:
            delta["logprobs"] = choice["logprobs"]
        yield _event(head | {"choices": [delta]})
        end = {"index": i, "delta": {}, "finish_reason": choice["finish_reason"]}
        yield _event(head | {"choices": [end]})
    yield _event(head | {"choices": [], "usage": answer["usage"]})
    yield "data: [DONE]\n\n"


def _text_stream(answer: dict[str, Any]) -> Iterator[str]:
    head = {k: answer[k] for k in ("id", "created", "model", "system_fingerprint", "object")}
    for choice in answer["choices"]:
        yield _event(head | {"choices": [choice]})
    yield "data: [DONE]\n\n"
