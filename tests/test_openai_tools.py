"""Tool calls through the OpenAI-compatible endpoint (``backends.services.openai_api.tools``): each
family's tool-call syntax parsed into OpenAI ``tool_calls`` (hostile text left as content),
requests with tools checked, and multi-turn tool-calling episodes through a rollout session,
driven by the official ``openai`` client, token-exact on the Qwen3 and Llama 3 family fixtures:
the trained ids are the sampled ones, every token; the trainer's log-probs equal the recorded
ones within 1e-5 (fp32); the masks cover exactly the sampled tokens; and the trajectory is what
the family's template renders for the conversation with its tools."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from families import BROKEN, FAMILIES, build_family, build_tokenizer, teach
from services import AppServer, assert_trained_exactly, session_client, session_endpoint

from flowrl.agent_loop.recorded import trajectories_from_turns
from flowrl.backends.services.openai_api.routes import request_messages
from flowrl.backends.services.openai_api.tools import (
    MAX_PARSED_CHARS,
    for_template,
    parse_tool_calls,
    tool_request,
)
from flowrl.infra.serving import ServiceError

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}
NAMES = {"add", "mul"}
HERMES_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 7}}\n</tool_call>'
LLAMA_CALL = '{"name": "add", "parameters": {"a": 12, "b": 7}}'


# ------------------------------------------------------------------- parsing, per family


def _calls(parsed) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed[1]]


@pytest.mark.parametrize("family", ["qwen3", "chatml"])
def test_hermes_blocks_become_tool_calls_and_the_rest_is_content(family):
    parsed = parse_tool_calls(family, HERMES_CALL, NAMES)
    assert parsed is not None and parsed[0] is None
    assert _calls(parsed) == [("add", {"a": 12, "b": 7})]
    (call,) = parsed[1]
    assert call["type"] == "function" and call["id"].startswith("call_")

    two = f'I will add, then multiply.\n{HERMES_CALL}\n<tool_call>\n{{"name": "mul"}}\n</tool_call>'
    content, calls = parse_tool_calls(family, two, NAMES)
    assert content == "I will add, then multiply."
    assert [c["function"]["name"] for c in calls] == ["add", "mul"]
    assert json.loads(calls[1]["function"]["arguments"]) == {}  # no arguments: none
    assert calls[0]["id"] != calls[1]["id"]


def test_a_llama3_answer_that_is_one_json_call_becomes_a_tool_call():
    parsed = parse_tool_calls("llama3", f"  {LLAMA_CALL}\n", NAMES)
    assert parsed is not None and parsed[0] is None
    assert _calls(parsed) == [("add", {"a": 12, "b": 7})]


HOSTILE = [
    ("qwen3", "The answer is 19."),  # no call at all
    ("qwen3", '<tool_call>\n{"name": "add", "arguments": {"a": 1}\n</tool_call>'),  # bad JSON
    ("qwen3", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),  # unknown tool
    ("qwen3", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}'),  # cut by max_tokens
    ("qwen3", f"{HERMES_CALL}\n</tool_call>"),  # a stray close tag
    ("qwen3", f"{HERMES_CALL}\n<tool_call>\nnot json\n</tool_call>"),  # one of two is bad
    ("qwen3", '<tool_call>\n{"name": "add", "arguments": "a=1"}\n</tool_call>'),  # not an object
    ("qwen3", '<tool_call>\n{"name": "add", "arguments": {}, "x": 1}\n</tool_call>'),  # extra key
    ("qwen3", '<tool_call>\n{"name": "add", "arguments": {"a": NaN}}\n</tool_call>'),
    ("qwen3", '<tool_call>\n["add", {"a": 1}]\n</tool_call>'),
    ("qwen3", "<tool_call>\n" + "[" * 100_000 + "\n</tool_call>"),  # deeper than the parser
    ("qwen3", '<tool_call>{"name": "add", "arguments": {"a": ' + "9" * 5000 + "}}</tool_call>"),
    ("qwen3", "<tool_call>" * 50_000),  # many opens, no close: linear, not quadratic
    (
        "qwen3",
        "<tool_call>"
        + json.dumps({"name": "add", "arguments": {"s": "x" * MAX_PARSED_CHARS}})
        + "</tool_call>",
    ),  # fmt: skip
    ("qwen3", "<tool_call>__import__('os').system('echo pwned')</tool_call>"),
    ("llama3", f"Sure! {LLAMA_CALL}"),  # not the whole answer
    ("llama3", '{"name": "add", "arguments": {"a": 1}}'),  # 3.1 writes "parameters"
    ("llama3", '{"name": "add", "parameters": [1, 2]}'),
    ("llama3", '[{"name": "add", "parameters": {}}]'),
    ("llama3", '{"name": 7, "parameters": {}}'),
    ("llama3", "{" * 100_000),
    ("gemma3", HERMES_CALL),  # a family without tool syntax parses nothing
    ("template", LLAMA_CALL),
]


@pytest.mark.parametrize(("family", "text"), HOSTILE, ids=range(len(HOSTILE)))
def test_hostile_or_malformed_answers_stay_content_and_never_raise(family, text):
    started = time.monotonic()
    assert parse_tool_calls(family, text, NAMES) is None
    assert time.monotonic() - started < 2.0


# ------------------------------------------------------------------- requests, checked


def test_tool_requests_are_checked_and_what_cannot_be_honoured_is_refused_naming_it():
    assert tool_request({}).definitions == [] and not tool_request({}).parse
    ok = tool_request({"tools": [ADD], "tool_choice": "auto", "parallel_tool_calls": True})
    assert ok.definitions == [ADD] and ok.parse and ok.names == {"add"}
    assert not tool_request({"tools": [ADD], "tool_choice": "none"}).parse
    function = ADD["function"]
    for tools, named in (
        ("add", "tools:"),
        ([{"type": "web_search"}], "tools[0].type"),
        ([{"type": "function"}], "tools[0].function"),
        ([{"type": "function", "function": {"name": 'a", "x": "'}}], "tools[0].function.name"),
        ([{"type": "function", "function": {"name": ""}}], "tools[0].function.name"),
        ([ADD, {"type": "function", "function": {**function, "parameters": "{}"}}],
         "tools[1].function.parameters"),
        ([{"type": "function", "function": {**function, "strict": True}}], "strict"),
        ([{"type": "function", "function": {**function, "examples": []}}], "examples"),
        ([ADD, ADD], "defined twice"),
    ):  # fmt: skip
        with pytest.raises(ServiceError) as refused:
            tool_request({"tools": tools})
        assert refused.value.status == 400 and named in str(refused.value)
    for body, named in (
        ({"tools": [ADD], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "add"}}},
         "tool_choice"),
        ({"tools": [ADD], "parallel_tool_calls": False}, "parallel_tool_calls"),
    ):  # fmt: skip
        with pytest.raises(ServiceError) as refused:
            tool_request(body)
        assert refused.value.status == 400 and named in str(refused.value)


def test_several_tool_results_render_together_as_the_template_groups_them():
    """Qwen writes consecutive tool results into one user turn: the continuation renders a
    turn's new messages together (``encode_turns``), so prompt + answer + results is exactly
    the template's own rendering."""
    from flowrl.backends.models.chat import HFChatFormat

    chat = HFChatFormat(build_tokenizer(FAMILIES["qwen3"]), sanitize_control_tokens=True)
    opening = [{"role": "user", "content": "Add 1 and 2, and 3 and 4."}]
    call = {"id": "c", "type": "function", "function": {"name": "add", "arguments": {}}}
    answer = {"role": "assistant", "content": "", "tool_calls": [call, {**call, "id": "d"}]}
    results = [{"role": "tool", "content": "3"}, {"role": "tool", "content": "7"}]
    one = '<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>'
    pieces = chat.encode_prompt(opening, [ADD]) + chat.encode_reply(f"{one}\n{one}")
    pieces += chat.encode_turns(results, [ADD])
    whole = chat.tokenizer.apply_chat_template(
        [*opening, answer, *results], tools=[ADD], add_generation_prompt=True, return_dict=False
    )
    assert pieces == list(whole)
    assert chat.tokenizer.decode(chat.encode_turns(results, [ADD])).count("<|im_start|>user") == 1


# ------------------------------------------------------------------- over HTTP, families

TEMPERATURE = 0.5
"""The rollout temperature (the trainer scores at it): low enough that a taught fixture
samples its lesson token for token, and not greedy, so the log-probs are a sampler's."""
QUESTION = [
    {"role": "system", "content": "You add numbers with the add tool."},
    {"role": "user", "content": "What is 12 + 7?"},
]
REPLIES = {
    "qwen3": (HERMES_CALL, "<think>\n\n</think>\n\n12 + 7 = 19."),
    "llama3": (LLAMA_CALL, "12 + 7 = 19."),
}
"""What each taught fixture answers: the call, then (after the tool's result) the answer."""
KEY = "tools-key-" + "t" * 24


def _teach_tool_episode(name: str, folder: str) -> None:
    """Teach the fixture ``REPLIES[name]``: the call on the question, the answer after the
    tool's result, rendered with ``ADD`` as the family's template writes them."""
    from flowrl.backends.models.chat import HFChatFormat

    chat = HFChatFormat.from_folder(folder)
    call, answer = REPLIES[name]
    prompt = chat.encode_prompt(QUESTION, [ADD])
    first = chat.encode_reply(call)
    result = chat.encode_turns([{"role": "tool", "content": "19"}], [ADD])
    second = chat.encode_reply(answer)
    tokens = prompt + first + result + second
    mask = [0] * len(prompt) + [1] * len(first) + [0] * len(result) + [1] * len(second)
    teach(folder, [tokens], [mask], steps=300)


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """Family fixtures: Qwen3 and Llama 3 taught ``REPLIES``; Gemma 3, Mistral and a ChatML
    template that writes no tools (``BROKEN``'s counting template) as they are."""
    out = {}
    for name in ("qwen3", "llama3", "gemma3", "mistral"):
        out[name] = build_family(FAMILIES[name], tmp_path_factory.mktemp(name))
    out["counting"] = build_family(BROKEN, tmp_path_factory.mktemp("counting"))
    for name in REPLIES:
        _teach_tool_episode(name, out[name])
    return out


@pytest.fixture(scope="module", params=sorted(REPLIES))
def sessions(request, folders, tmp_path_factory) -> Iterator[tuple]:
    """A session endpoint on a taught fixture: (family, table, server, trainer)."""
    cache = str(tmp_path_factory.mktemp("cache"))
    folder = folders[request.param]
    with session_endpoint(folder, cache, TEMPERATURE, context_length=2048, max_tokens=64) as out:
        yield (request.param, *out)


def test_a_tool_calling_episode_trains_exactly_the_sampled_tokens(sessions):

    _, table, server, trainer = sessions
    session = table.open()
    client = session_client(server, session)
    messages: list = list(QUESTION)
    first = client.chat.completions.create(
        model="policy", messages=messages, tools=[ADD], max_tokens=48
    ).choices[0]
    assert first.finish_reason == "tool_calls" and not first.message.content, first.message
    (call,) = first.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 12, "b": 7}
    # The agent sends the answer back as the client returned it, then the tool's result.
    messages += [first.message, {"role": "tool", "tool_call_id": call.id, "content": "19"}]
    second = client.chat.completions.create(
        model="policy", messages=messages, tools=[ADD], max_tokens=48
    ).choices[0]
    assert second.finish_reason == "stop" and not second.message.tool_calls
    assert second.message.content == "12 + 7 = 19."

    sampled = first.model_extra["token_ids"] + second.model_extra["token_ids"]
    turns = table.close(session)
    t = assert_trained_exactly(turns, sampled, trainer, TEMPERATURE)

    # What was trained is the family's own rendering of the conversation and its tools.
    dumped = [m if isinstance(m, dict) else m.model_dump() for m in messages]
    conversation = request_messages([*dumped, second.message.model_dump()])
    whole = table.chat.tokenizer.apply_chat_template(
        for_template(conversation), tools=[ADD], return_dict=False
    )
    assert list(whole[: len(t.tokens)]) == t.tokens
    assert table.chat.tokenizer.decode(whole[len(t.tokens) :]).strip() == ""


def test_an_edited_call_or_changed_tools_start_a_new_trajectory(sessions):
    _, table, server, _ = sessions
    session = table.open()
    client = session_client(server, session)
    mul = {"type": "function", "function": {**ADD["function"], "name": "mul"}}
    first = client.chat.completions.create(
        model="policy", messages=QUESTION, tools=[ADD], max_tokens=48
    ).choices[0]
    (call,) = first.message.tool_calls
    edited = first.message.model_dump()
    edited["tool_calls"][0]["function"]["arguments"] = '{"a": 12, "b": 8}'
    messages = [*QUESTION, edited, {"role": "tool", "tool_call_id": call.id, "content": "20"}]
    second = client.chat.completions.create(
        model="policy", messages=messages, tools=[ADD], max_tokens=48
    ).choices[0]
    messages += [second.message.model_dump(), {"role": "user", "content": "Thanks."}]
    client.chat.completions.create(
        model="policy", messages=messages, tools=[ADD, mul], max_tokens=8
    )
    pieces = trajectories_from_turns(table.close(session), "ep", 0, reward=0.5)
    assert len(pieces) == 3
    rendered = table.chat.encode_prompt(for_template(request_messages(messages[:4])), [ADD])
    assert pieces[1].tokens[: pieces[1].prompt_len] == rendered
    for piece in pieces:
        assert len(piece.tokens) == len(piece.loss_mask) == len(piece.logprobs)


def test_a_session_refuses_tools_it_cannot_honour_and_serves_on(sessions):
    _, table, server, _ = sessions
    session = table.open()
    url = f"{server.url}/sessions/{session.session_id}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {session.key}"}
    body = {"model": "policy", "messages": QUESTION, "max_tokens": 4}
    for bad, named in (
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [ADD], "tool_choice": "required"}, "tool_choice"),
        ({"tools": [ADD], "stream": True}, "stream"),
    ):
        refused = httpx.post(url, json=body | bad, headers=headers, timeout=60)
        assert refused.status_code == 400 and named in refused.json()["detail"], refused.text
        assert httpx.post(url, json=body, headers=headers, timeout=60).status_code == 200
    table.close(session)


@pytest.fixture(scope="module")
def endpoint(folders, tmp_path_factory) -> Iterator[AppServer]:
    """``flowrl serve openai``'s app on the fixtures (and ``flowrl/tiny``, flowrl's own
    format), with its own FLOWRL_HOME."""
    from flowrl.backends.services.openai_api.routes import create_app
    from flowrl.backends.services.openai_api.service import OpenAIService

    saved = os.environ.get("FLOWRL_HOME")
    os.environ["FLOWRL_HOME"] = str(tmp_path_factory.mktemp("flowrl-home"))
    try:
        catalogue = {"flowrl/tiny": "tiny", **folders}
        server = AppServer(create_app(OpenAIService(keys={KEY: "alice"}, catalogue=catalogue)))
        yield server
        server.stop()
    finally:
        if saved is None:
            os.environ.pop("FLOWRL_HOME", None)
        else:
            os.environ["FLOWRL_HOME"] = saved


def test_the_endpoint_answers_tool_calls_streamed_or_not(endpoint):
    client = openai.OpenAI(base_url=f"{endpoint.url}/v1", api_key=KEY, max_retries=0)
    asked = dict(model="qwen3", messages=QUESTION, tools=[ADD], temperature=0, max_tokens=48)
    choice = client.chat.completions.create(**asked).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "add" and json.loads(call.function.arguments) == {"a": 12, "b": 7}

    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**asked, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for delta in c.delta.tool_calls or []:
                calls.setdefault(delta.index, {"name": "", "arguments": ""})
                calls[delta.index]["name"] += delta.function.name or ""
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0] == {"name": "add", "arguments": call.function.arguments}

    plain = client.chat.completions.create(**asked, tool_choice="none").choices[0]
    assert plain.finish_reason == "stop" and plain.message.tool_calls is None
    assert plain.message.content == HERMES_CALL  # the model's text, unparsed


ASSISTANT_CALL = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    ],
}


@pytest.mark.parametrize(
    ("model", "extra", "named"),
    [
        ("flowrl/tiny", {"tools": [ADD]}, "('flowrl') cannot express tool calls"),
        ("gemma3", {"tools": [ADD]}, "('gemma3') cannot express tool calls"),
        ("mistral", {"tools": [ADD]}, "('mistral') cannot express tool calls"),
        ("counting", {"tools": [ADD]}, "does not render tool definitions"),
        ("gemma3", {"messages": [*QUESTION, ASSISTANT_CALL]}, "cannot express tool calls"),
        ("qwen3", {"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
        ("qwen3", {"tools": [ADD], "tool_choice": "required"}, "tool_choice"),
        ("qwen3", {"tools": [ADD], "parallel_tool_calls": False}, "parallel_tool_calls"),
        ("qwen3", {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, None),
        (
            "qwen3",
            {"messages": [*QUESTION, {**ASSISTANT_CALL, "tool_calls": [{"id": "c"}]}]},
            "messages[2].tool_calls[0]",
        ),
        (
            "qwen3",
            {"messages": [{"role": "user", "content": "hi", "tool_calls": ASSISTANT_CALL[
                "tool_calls"]}]},
            "messages[0].tool_calls: on assistant messages only",
        ),
        (
            "llama3",
            {"tools": [ADD], "messages": [*QUESTION, {**ASSISTANT_CALL, "tool_calls": [
                *ASSISTANT_CALL["tool_calls"]] * 2}, {"role": "tool", "content": "1"}]},
            "single tool-calls",
        ),
    ],
)  # fmt: skip
def test_tools_a_model_cannot_express_or_malformed_are_a_400_and_it_serves_on(
    endpoint, model, extra, named
):
    url = f"{endpoint.url}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": model, "messages": QUESTION, "max_tokens": 4} | extra
    response = httpx.post(url, json=body, headers=headers, timeout=120)
    if named is None:  # an empty tool_calls list is no tool call
        assert response.status_code == 200, response.text
    else:
        assert response.status_code == 400, response.text
        assert named in response.json()["detail"]
    ok = {"model": model, "messages": QUESTION, "max_tokens": 2}
    assert httpx.post(url, json=ok, headers=headers, timeout=120).status_code == 200


def test_text_completions_refuse_tools(endpoint):
    response = httpx.post(
        f"{endpoint.url}/v1/completions",
        json={"model": "qwen3", "prompt": "12+7=", "tools": [ADD], "max_tokens": 2},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert response.status_code == 400 and "tools" in response.json()["detail"]
