"""Rollout sessions (``backends.services.openai_api.sessions``) and the trajectories built from what
they record (``agent_loop.recorded``): an agent written with the official ``openai`` client
talks to its session over HTTP; the trajectory trains exactly the tokens that were sampled.

Token-exact on the Qwen3 and Llama 3 family fixtures (tests/families.py): for a multi-turn
conversation (answers, a tool result, a user follow-up), the trajectory's mask-1 tokens are the
sampled ids, every one; the trainer's log-probs of them equal the recorded ones within 1e-5
(fp32); masks cover exactly the sampled tokens. An agent that rewrites its history gets two
trajectories, each consistent, not one corrupted."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from families import FAMILIES, build_family
from services import assert_trained_exactly, session_client, session_endpoint

from flowrl.agent_loop.recorded import Turn, trajectories_from_turns
from flowrl.agent_loop.types import StopReason


def test_turns_that_extend_each_other_merge_with_masks_and_the_reward_on_the_last():
    first = Turn([1, 2], [3, 4], [-0.1, -0.2], "stop")
    second = Turn([1, 2, 3, 4, 5, 6], [7], [-0.3], "stop")
    (t,) = trajectories_from_turns([first, second], "e0", 3, reward=1.5)
    assert t.tokens == [1, 2, 3, 4, 5, 6, 7]
    assert t.loss_mask == [0, 0, 1, 1, 0, 0, 1]
    assert t.logprobs == [0.0, 0.0, -0.1, -0.2, 0.0, 0.0, -0.3]
    assert t.prompt_len == 2 and t.group_id == 3 and t.reward == 1.5
    assert t.turn_rewards == [0.0, 1.5] and t.stop_reason is StopReason.DONE


def test_a_rewritten_history_starts_a_new_trajectory_with_the_episode_reward():
    turns = [
        Turn([1, 2], [3], [-0.1], "stop"),
        Turn([1, 9, 5], [6], [-0.2], "length"),  # the agent edited its first message
    ]
    pieces = trajectories_from_turns(turns, "e1", 0, reward=1.0)
    assert [p.tokens for p in pieces] == [[1, 2, 3], [1, 9, 5, 6]]
    assert [p.loss_mask for p in pieces] == [[0, 0, 1], [0, 0, 0, 1]]
    assert [p.reward for p in pieces] == [1.0, 1.0]
    assert [p.episode_id for p in pieces] == ["e1", "e1-1"]
    assert all(p.info["pieces"] == 2 for p in pieces)


def test_an_episode_without_requests_trains_nothing_and_keeps_its_reward():
    (t,) = trajectories_from_turns([], "e2", 1, reward=0.0, stop_reason=StopReason.ERROR)
    assert t.tokens == [] and t.num_sampled_tokens == 0 and t.failed


# ------------------------------------------------------------------- over HTTP, families

TEMPERATURE = 1.0


@pytest.fixture(scope="module", params=["qwen3", "llama3"])
def family(request, tmp_path_factory) -> Iterator[tuple]:
    """A session endpoint on a family fixture's model: sampler and trainer in this process."""
    folder = build_family(FAMILIES[request.param], tmp_path_factory.mktemp(request.param))
    cache = str(tmp_path_factory.mktemp("cache"))
    with session_endpoint(folder, cache, TEMPERATURE, context_length=512, max_tokens=12) as out:
        yield out


def _ask(client: openai.OpenAI, messages: list[dict]) -> tuple[str, list[int]]:
    answer = client.chat.completions.create(model="policy", messages=messages, max_tokens=8)
    choice = answer.choices[0]
    return choice.message.content, choice.model_extra["token_ids"]


def test_a_multi_turn_episode_trains_exactly_the_sampled_tokens(family):

    table, server, trainer = family
    session = table.open()
    client = session_client(server, session)
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 12 + 7?"},
    ]
    sampled: list[int] = []
    for follow_up in (
        {"role": "tool", "content": "calculator: 19"},
        {"role": "user", "content": "And 3 + 4?"},
        None,
    ):
        text, ids = _ask(client, messages)
        sampled += ids
        messages.append({"role": "assistant", "content": text})
        if follow_up is not None:
            messages.append(follow_up)
    turns = table.close(session)
    assert len(turns) == 3
    assert_trained_exactly(turns, sampled, trainer, TEMPERATURE)


def test_a_rewritten_history_is_split_not_corrupted(family):
    table, server, _ = family
    session = table.open()
    client = session_client(server, session)
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    text, _ = _ask(client, messages)
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "Sure?"}]
    _ask(client, messages)
    rewritten = [{"role": "user", "content": "Summary: we added 2 and 2. Say the sum."}]
    _ask(client, rewritten)
    pieces = trajectories_from_turns(table.close(session), "ep", 0, reward=0.5)
    assert len(pieces) == 2
    assert pieces[1].tokens[: pieces[1].prompt_len] == table.chat.encode_prompt(rewritten)
    for piece in pieces:
        assert len(piece.tokens) == len(piece.loss_mask) == len(piece.logprobs)


def test_a_session_answers_its_own_key_only_and_not_after_it_closed(family):
    table, server, _ = family
    mine, theirs = table.open(), table.open()
    url = f"{server.url}/sessions/{mine.session_id}/v1/chat/completions"
    body = {"model": "policy", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    bearer = {"Authorization": f"Bearer {theirs.key}"}
    assert httpx.post(url, json=body, headers=bearer, timeout=60).status_code == 404
    hot = body | {"temperature": 0.3}
    answer = httpx.post(url, json=hot, headers={"Authorization": f"Bearer {mine.key}"}, timeout=60)
    assert answer.status_code == 400 and "temperature" in answer.json()["detail"]
    for bad, named in (({"max_tokens": "many"}, "max_tokens"), ({"n": 2}, "n:")):
        refused = httpx.post(
            url, json=body | bad, headers={"Authorization": f"Bearer {mine.key}"}, timeout=60
        )
        assert refused.status_code == 400 and named in refused.json()["detail"]
    table.close(mine)
    with pytest.raises(openai.NotFoundError):
        session_client(server, mine).chat.completions.create(
            model="policy", messages=body["messages"]
        )
    table.close(theirs)
