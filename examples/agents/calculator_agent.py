"""A plain ``openai``-SDK agent with a calculator tool, trained by flowrl as it is.

Nothing here knows flowrl's agent loop: the agent talks to an OpenAI endpoint with the official
client, calls its own tool, and returns its final answer. flowrl gives it an endpoint bound to
one rollout (``rollout.client()``: base URL and key of a rollout session) and the task's row and
opening; the task (``tool_math``) scores the answer it returns.

The tool syntax is the one the task's system prompt teaches: a reply
``<tool_call>{"expr": "47*86"}</tool_call>`` is a call. The agent evaluates the expression with
a safe calculator (never ``eval``) and sends the result back as a ``tool`` message; any other
reply is the final answer. The tiny model's chat format has no function-calling syntax of its
own, so the calls travel in the text (a model of a family with one would get ``tools=`` and
answer with ``message.tool_calls``).

    PYTHONPATH=examples/agents .venv/bin/flowrl train examples/agents/calculator-agent.yaml
"""

from __future__ import annotations

import json
import re

from flowrl.environments.agent import AgentRollout
from flowrl.environments.calculator import CalculatorError, calculate

CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
MAX_CALLS = 2


def calculator(payload: str) -> str:
    """The tool: ``{"expr": "..."}`` → the value, or ``error: ...``."""
    try:
        expr = json.loads(payload)["expr"]
        return calculate(str(expr))
    except (ValueError, KeyError, TypeError, CalculatorError) as err:
        return f"error: {err}"[:200]


async def run(rollout: AgentRollout) -> str:
    """Ask, run the calculator while the model calls it, return the final answer."""
    client = rollout.client()
    messages = rollout.messages()
    async with client:
        for _ in range(MAX_CALLS + 1):
            answer = await client.chat.completions.create(model=rollout.model, messages=messages)
            text = answer.choices[0].message.content or ""
            call = CALL.search(text)
            if call is None:
                return text
            messages.append({"role": "assistant", "content": text})
            messages.append({"role": "tool", "content": calculator(call.group(1))})
    return text
