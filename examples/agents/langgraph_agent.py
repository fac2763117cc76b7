"""A LangGraph agent with a calculator tool, trained by flowrl as it is.

A two-node graph: ``model`` (LangChain's ``ChatOpenAI`` on the rollout's endpoint) and
``calculator``, looping while the model calls the tool. It is ordinary LangGraph code; flowrl
only provides the endpoint (``rollout.base_url``, ``rollout.api_key``), the task's opening, and
scores the final answer with the ``tool_math`` task.

As in ``calculator_agent.py``, the tool syntax is the one the task's system prompt teaches
(``<tool_call>{"expr": "47*86"}</tool_call>`` in the reply): the tiny model's chat format has no
function-calling syntax, so the graph routes on the text rather than on ``tool_calls``.

    uv pip install langgraph langchain-openai
    PYTHONPATH=examples/agents .venv/bin/flowrl train examples/agents/langgraph-agent.yaml
"""

from __future__ import annotations

from typing import Annotated, TypedDict

from calculator_agent import CALL, MAX_CALLS, calculator
from langchain_core.messages import AnyMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.graph.message import add_messages

from flowrl.environments.agent import AgentRollout


class State(TypedDict):
    messages: Annotated[list[AnyMessage], add_messages]
    calls: int


def build_graph(model: ChatOpenAI):  # noqa: ANN201 - LangGraph's compiled graph
    async def think(state: State) -> dict:
        return {"messages": [await model.ainvoke(state["messages"])]}

    def calculate(state: State) -> dict:
        call = CALL.search(state["messages"][-1].content)
        result = ToolMessage(
            content=calculator(call.group(1)), tool_call_id=f"call-{state['calls']}"
        )
        return {"messages": [result], "calls": state["calls"] + 1}

    def route(state: State) -> str:
        called = CALL.search(state["messages"][-1].content)
        return "calculator" if called and state["calls"] < MAX_CALLS else END

    graph = StateGraph(State)
    graph.add_node("model", think)
    graph.add_node("calculator", calculate)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", route, ["calculator", END])
    graph.add_edge("calculator", "model")
    return graph.compile()


async def run(rollout: AgentRollout) -> str:
    model = ChatOpenAI(
        model=rollout.model,
        base_url=rollout.base_url,
        api_key=rollout.api_key,
        max_retries=0,
        # One TLS context for every episode (a client of its own costs ~17 ms of CPU).
        http_async_client=rollout.http_client(),
        http_client=rollout.http_client(asynchronous=False),
    )
    system = [SystemMessage(rollout.system_prompt)] if rollout.system_prompt else []
    try:
        state = await build_graph(model).ainvoke(
            {"messages": [*system, HumanMessage(rollout.prompt)], "calls": 0}
        )
    finally:
        await model.root_async_client.close()  # its connections belong to this episode's loop
    return state["messages"][-1].content
