"""Agents for tests/test_agents.py, loaded by name (``env.name: agent:sample_agents:<name>``),
and a sampler that answers by rule. Written as a user would: the ``openai`` client only."""

from __future__ import annotations

import asyncio
import time

import openai
from fakes import ByteChat, say

from flowrl.agent_loop.types import SampleResult
from flowrl.environments.agent import AgentRollout

STASH: dict[str, AgentRollout] = {}
"""Rollouts kept by ``stash_then_answer`` (a test then tries their keys after the episode)."""
LOGPROB = -0.25


class RuleSampler:
    """Answers every prompt with ``answer(prompt_text)`` (ByteChat), log-prob ``LOGPROB`` a
    token; records the prompts it saw."""

    def __init__(self, answer=lambda text: "7") -> None:  # noqa: ANN001 - a rule
        self.answer = answer
        self.prompts: list[list[int]] = []

    def sample(self, prompts, max_new_tokens, temperature, images=None):  # noqa: ANN001
        self.prompts += [list(p) for p in prompts]
        out = []
        for prompt in prompts:
            tokens = say(self.answer(ByteChat().decode(prompt)))[:max_new_tokens]
            finish = "stop" if len(tokens) < max_new_tokens or tokens[-1] == 259 else "length"
            out.append(SampleResult(tokens, [LOGPROB] * len(tokens), finish))
        return out


async def ask(rollout: AgentRollout, messages: list[dict]) -> str:
    async with rollout.client() as client:
        answer = await client.chat.completions.create(model=rollout.model, messages=messages)
    return answer.choices[0].message.content


async def answer_once(rollout: AgentRollout) -> str:
    """One request; the answer is scored by the task."""
    return await ask(rollout, rollout.messages())


async def guess_until_right(rollout: AgentRollout) -> str:
    """Multi-turn: guesses, reads the hint, guesses again (3 requests at most)."""
    messages = rollout.messages()
    for _ in range(3):
        guess = await ask(rollout, messages)
        messages += [{"role": "assistant", "content": guess}, {"role": "user", "content": "again"}]
    return guess


async def dawdles_between_turns(rollout: AgentRollout) -> str:
    """Multi-turn (3 requests) with a pause of its own before each, longer for later rows: the
    requests of a batch arrive in a different order every turn."""
    target = rollout.row["target"]
    messages = rollout.messages()
    messages[-1]["content"] += f" (row {target})"
    for turn in range(3):
        await asyncio.sleep(0.01 * ((target * (turn + 3)) % 7))
        guess = await ask(rollout, messages)
        messages += [{"role": "assistant", "content": guess}, {"role": "user", "content": "again"}]
    return guess


def answer_once_blocking(rollout: AgentRollout) -> str:
    """A plain function with the synchronous client: flowrl runs it in a thread."""
    client = openai.OpenAI(base_url=rollout.base_url, api_key=rollout.api_key, max_retries=0)
    answer = client.chat.completions.create(model="anything", messages=rollout.messages())
    return answer.choices[0].message.content


async def own_reward(rollout: AgentRollout) -> float:
    await ask(rollout, rollout.messages())
    return 0.25 * rollout.row["target"]


async def raises(rollout: AgentRollout) -> str:
    await ask(rollout, rollout.messages())
    raise RuntimeError("agent bug")


async def returns_a_list(rollout: AgentRollout) -> list:
    return [1]


async def hangs_on_odd_targets(rollout: AgentRollout) -> str:
    """Awaits forever for odd targets; answers at once for even ones."""
    if rollout.row["target"] % 2:
        await asyncio.sleep(3600)
    return await answer_once(rollout)


def blocks_on_odd_targets(rollout: AgentRollout) -> str:
    """A plain function that blocks for odd targets (its thread is abandoned)."""
    if rollout.row["target"] % 2:
        time.sleep(3600)
    return answer_once_blocking(rollout)


async def never_stops_asking(rollout: AgentRollout) -> str:
    """Asks until a request is refused (rollout.max_turns), then gives up by raising."""
    messages = rollout.messages()
    while True:
        text = await ask(rollout, messages)
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "more"}]


async def stash_then_answer(rollout: AgentRollout) -> str:
    STASH[rollout.episode_id] = rollout
    return await answer_once(rollout)


def reward_by_length(row: dict, result: object) -> float:
    """A reward function named in config: ``env.params.reward``."""
    return float(len(str(result)))
