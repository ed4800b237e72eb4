"""LangGraph graphs the tests run, in-process and in `agent-runs worker --agent
tests.langgraph_agents:agent` processes: one LangGraphAgent per agent slug.

Every step of the `lg-steps` graph records its side effect in `lg_side_effects` (run, step,
attempt), through the worker's pool, so a test counts how often each step ran.
"""

from __future__ import annotations

import operator
import time
from typing import Annotated, Any, TypedDict

from langchain_core.language_models.fake_chat_models import FakeMessagesListChatModel
from langchain_core.messages import AIMessage, AnyMessage, ToolMessage
from langchain_core.tools import tool
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.types import interrupt

from agent_runs.langgraph import LangGraphAgent, run_context
from agent_runs.models import AgentRun
from agent_runs.worker import AgentResult, RetryableError, RunContext

SIDE_EFFECTS_DDL = """
CREATE TABLE IF NOT EXISTS lg_side_effects (
    run_id text NOT NULL, step text NOT NULL, attempt integer NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp())
"""
STEPS = ("s1", "s2", "s3", "s4", "s5")


class Steps(TypedDict, total=False):
    steps: Annotated[list[str], operator.add]
    steps_wanted: int
    delay: float
    hold_at: str
    retry_at: str


def _side_effect(step: str) -> None:
    ctx = run_context()
    with ctx.pool.connection() as conn:
        conn.execute(
            "INSERT INTO lg_side_effects (run_id, step, attempt) VALUES (%s, %s, %s)",
            (ctx.run_id, step, ctx.attempt_no),
        )


def _step(name: str) -> Any:
    def node(state: Steps) -> dict[str, Any]:
        ctx = run_context()
        if state.get("hold_at") == name and ctx.attempt_no == 1:
            # Stuck before its side effect: the test kills the process here.
            _side_effect(f"{name}:entered")
            while True:
                time.sleep(0.1)
        if state.get("retry_at") == name and ctx.attempt_no == 1:
            raise RetryableError(f"{name}: provider timeout")
        if state.get("delay"):
            ctx.wait(float(state["delay"]))
        _side_effect(name)
        return {"steps": [name]}

    return node


def _steps_graph() -> StateGraph[Any]:
    graph = StateGraph(Steps)
    for name in STEPS:
        graph.add_node(name, _step(name))
    graph.add_edge(START, "s1")
    for index, name in enumerate(STEPS):
        following = STEPS[index + 1] if index + 1 < len(STEPS) else END

        def route(state: Steps, following: str = following, index: int = index) -> str:
            return following if index + 1 < state.get("steps_wanted", len(STEPS)) else END

        graph.add_conditional_edges(name, route, [following, END] if following != END else [END])
    return graph


class Asked(TypedDict, total=False):
    question: str
    answer: str


def _ask(state: Asked) -> dict[str, Any]:
    answer = interrupt({"question": state["question"]})
    return {"answer": f"the answer is {answer}"}


def _asking_graph() -> StateGraph[Any]:
    graph = StateGraph(Asked)
    graph.add_node("ask", _ask)
    graph.add_edge(START, "ask")
    graph.add_edge("ask", END)
    return graph


@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


# The fake model's turns: a tool call, then the answer that reads the tool's result.
def _model(state: MessagesState) -> dict[str, list[AnyMessage]]:
    turns = sum(isinstance(m, AIMessage) for m in state["messages"])
    if turns == 0:
        reply = AIMessage(
            content="",
            tool_calls=[{"name": "multiply", "args": {"a": 6, "b": 7}, "id": "call-1"}],
        )
    else:
        result = next(m for m in state["messages"] if isinstance(m, ToolMessage))
        reply = AIMessage(content=f"6 x 7 = {result.content}")
    model = FakeMessagesListChatModel(responses=[reply])
    return {"messages": [model.invoke(state["messages"])]}


def _tools(state: MessagesState) -> dict[str, list[AnyMessage]]:
    last = state["messages"][-1]
    assert isinstance(last, AIMessage)
    return {
        "messages": [
            ToolMessage(content=str(multiply.invoke(call["args"])), tool_call_id=call["id"])
            for call in last.tool_calls
        ]
    }


def _route_tools(state: MessagesState) -> str:
    last = state["messages"][-1]
    return "tools" if isinstance(last, AIMessage) and last.tool_calls else END


def _tool_graph() -> StateGraph[Any]:
    graph = StateGraph(MessagesState)
    graph.add_node("model", _model)
    graph.add_node("tools", _tools)
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", _route_tools, ["tools", END])
    graph.add_edge("tools", "model")
    return graph


class Delegating(TypedDict, total=False):
    children: int
    total: int


def _delegate(state: Delegating) -> dict[str, Any]:
    ctx = run_context()
    runs = [
        ctx.create_subagent_run(agent_slug="lg-steps", input_payload={"steps_wanted": 2})
        for _ in range(state.get("children", 2))
    ]
    ended = [ctx.wait_for_run(child.id, 60) for child in runs]
    return {"total": sum(len(child.output["steps"]) for child in ended)}


def _delegating_graph() -> StateGraph[Any]:
    graph = StateGraph(Delegating)
    graph.add_node("delegate", _delegate)
    graph.add_edge(START, "delegate")
    graph.add_edge("delegate", END)
    return graph


AGENTS = {
    "lg-steps": LangGraphAgent(_steps_graph()),
    "lg-ask": LangGraphAgent(_asking_graph()),
    "lg-tools": LangGraphAgent(_tool_graph()),
    "lg-delegate": LangGraphAgent(_delegating_graph(), output=lambda state: state["total"]),
}


def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
    """The agent of the run's slug."""
    return AGENTS[run.agent_slug](run, ctx)


def close() -> None:
    for each in AGENTS.values():
        each.close()
