"""Durable LangGraph agents: a graph run under the worker's lease, checkpointed in PostgreSQL, so
a later attempt resumes where the last one stopped (the extra `agent_runs[langgraph]`).

    agent = LangGraphAgent(builder)            # a StateGraph builder (or saver -> compiled graph)
    Worker(pool, agent).run_forever(stop)      # after `agent-runs migrate --langgraph`

- **Checkpoints** are `langgraph-checkpoint-postgres`'s (`PostgresSaver`, its own tables, created
  by `setup()`), on the worker's database. One LangGraph thread per agent_runs thread: its id is
  `thread_key(uid, agent_slug, thread_id)` = `agent_runs/<uid>/<agent_slug>/<thread_id>`, each
  part percent-encoded (RFC 3986, nothing kept, so `/` separates and the encoding is one to one).
  Checkpoints carry `agent_runs_run_id` and `agent_runs_attempt` in their metadata.
- **Input.** A `chat` or `subagent` run's graph input is its `input_payload`; a `resume` run
  sends `Command(resume=input_payload["resume"])` (a value, or a map of interrupt id to value).
- **Step by step.** The graph runs superstep by superstep with checkpoints written before the
  next step starts (`durability="sync"`); between steps the run's stop request is checked: a
  cancel ends the run `cancelled` before any further step starts; a shutdown releases it and a
  lost lease leaves it to the reconciler, its last checkpoint kept.
- **Resume.** When the thread's latest checkpoint was written by this run (an earlier attempt:
  a retry, a requeue, a lost lease that the policy retries), the attempt continues from it and
  records where (`RunAttempt.resumed_from`, `resumed_step`). A step whose checkpoint committed
  never runs again; a step cut between its side effect and its checkpoint runs again: side
  effects are at least once per step.
- **Ends.** `interrupt(value)` in a node ends the run `interrupted` / `human_input_required`
  with `output` = `[{"id": ..., "value": ...}]`, the pending interrupts. Otherwise the run
  completes with `output` = the final state as JSON (LangChain messages in their dict form,
  `message_to_dict`), or what the `output` callable makes of the final state.
- Inside a node, `run_context()` is the run's RunContext (its sub-agent calls are keyed by the
  node's task, so a resumed step finds the children it started).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from typing import Any, Final
from urllib.parse import quote

from langchain_core.messages import BaseMessage, message_to_dict
from langgraph.checkpoint.postgres import PostgresSaver
from langgraph.config import get_config
from langgraph.errors import GraphDrained
from langgraph.graph import StateGraph
from langgraph.runtime import RunControl
from langgraph.types import Command, StateSnapshot
from psycopg import Connection
from psycopg.rows import DictRow, dict_row
from psycopg_pool import ConnectionPool
from pydantic import BaseModel

from agent_runs.models import AgentRun
from agent_runs.worker.protocol import AgentResult, RunContext

__all__ = [
    "HUMAN_INPUT_REQUIRED",
    "LangGraphAgent",
    "run_context",
    "setup",
    "thread_key",
    "to_json",
]

HUMAN_INPUT_REQUIRED: Final = "human_input_required"
THREAD_PREFIX: Final = "agent_runs"
# Metadata keys of the checkpoints a run writes (LangGraph keeps its own `run_id` apart).
RUN_ID_KEY: Final = "agent_runs_run_id"
ATTEMPT_KEY: Final = "agent_runs_attempt"

_current: ContextVar[RunContext | None] = ContextVar("agent_runs_langgraph_context", default=None)

GraphSource = StateGraph[Any] | Callable[[PostgresSaver], Any]


def thread_key(uid: str, agent_slug: str, thread_id: str) -> str:
    """The LangGraph thread id of an agent_runs thread (see the module docstring)."""
    parts = (quote(part, safe="") for part in (uid, agent_slug, thread_id))
    return "/".join((THREAD_PREFIX, *parts))


def run_context() -> RunContext:
    """The RunContext of the run whose graph is executing (call it inside a node)."""
    ctx = _current.get()
    if ctx is None:
        raise RuntimeError("run_context() is only available inside a node of a LangGraphAgent")
    return ctx


def setup(dsn: str) -> None:
    """Create or upgrade langgraph-checkpoint-postgres's tables (its own migrations), with no
    prepared statement (so through a transaction pooler too)."""
    with Connection.connect(
        dsn, autocommit=True, prepare_threshold=None, row_factory=dict_row
    ) as conn:
        PostgresSaver(conn).setup()


def to_json(value: Any) -> Any:
    """`value` as plain JSON: LangChain messages in their dict form (`message_to_dict`),
    pydantic models dumped, mappings with str keys, tuples as lists; anything else as its str."""
    if isinstance(value, BaseMessage):
        return to_json(message_to_dict(value))
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, Mapping):
        return {str(k): to_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_json(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


class _StopBetweenSteps(RunControl):
    """LangGraph's drain request, read at each superstep boundary: the run's stop request."""

    __slots__ = ("_ctx",)

    def __init__(self, ctx: RunContext) -> None:
        super().__init__()
        self._ctx = ctx

    @property
    def drain_requested(self) -> bool:
        return self._ctx.should_stop()

    @property
    def drain_reason(self) -> str | None:
        return self._ctx.stop_reason()


def _node_scope() -> str | None:
    """The executing node's task namespace (stable for a step resumed from its checkpoint)."""
    try:
        config = get_config()
    except RuntimeError:
        return None
    namespace = config.get("configurable", {}).get("checkpoint_ns")
    return str(namespace) if namespace else None


class LangGraphAgent:
    """An agent for Worker that runs a LangGraph graph durably (see the module docstring).

    `graph`: a StateGraph builder (compiled here with the checkpointer), or a callable taking
    the PostgresSaver and returning a compiled graph. `output`: final state -> the run's output.
    """

    def __init__(self, graph: GraphSource, *, output: Callable[[Any], Any] | None = None) -> None:
        self._source = graph
        self._output = output
        self._lock = threading.Lock()
        self._compiled: dict[int, tuple[ConnectionPool[Connection[DictRow]], Any]] = {}

    def __call__(self, run: AgentRun, ctx: RunContext) -> AgentResult:
        graph = self._graph(ctx.pool)
        config: dict[str, Any] = {
            "configurable": {"thread_id": thread_key(run.uid, run.agent_slug, run.thread_id)},
            "metadata": {RUN_ID_KEY: run.id, ATTEMPT_KEY: ctx.attempt_no},
        }
        state: StateSnapshot = graph.get_state(config)
        start: Any
        if state.metadata is not None and state.metadata.get(RUN_ID_KEY) == run.id:
            # An earlier attempt of this run checkpointed: continue from its last checkpoint.
            ctx.record_resumed_from(
                str(state.config["configurable"]["checkpoint_id"]),
                int(state.metadata.get("step", -1)),
            )
            if not state.next or state.interrupts:
                return self._result(state)
            start = None
        elif run.run_type == "resume":
            if "resume" not in run.input_payload:
                return AgentResult.failed(
                    "invalid_input", "a resume run's input_payload needs a 'resume' value"
                )
            start = Command(resume=run.input_payload["resume"])
        else:
            start = dict(run.input_payload)
        token = _current.set(ctx)
        ctx.subagent_scope = _node_scope
        try:
            for _ in graph.stream(
                start,
                config,
                stream_mode="updates",
                durability="sync",
                control=_StopBetweenSteps(ctx),
            ):
                pass
        except GraphDrained as drained:
            return AgentResult.failed(
                "graph_stopped",
                f"stopped between two steps ({drained.reason}); its last checkpoint is kept",
            )
        finally:
            ctx.subagent_scope = None
            _current.reset(token)
        return self._result(graph.get_state(config))

    def _result(self, state: StateSnapshot) -> AgentResult:
        if state.interrupts:
            pending = [{"id": i.id, "value": to_json(i.value)} for i in state.interrupts]
            waiting = ", ".join(state.next) or "an interrupt"
            return AgentResult.interrupted(
                HUMAN_INPUT_REQUIRED,
                f"the graph waits for input at {waiting}; a resume run continues it",
                output=pending,
            )
        values = state.values
        output = self._output(values) if self._output is not None else to_json(values)
        return AgentResult.completed(output=output)

    def _graph(self, pool: ConnectionPool) -> Any:
        """The graph compiled with a PostgresSaver on the worker's database (one per pool)."""
        key = id(pool)
        options = pool.kwargs if isinstance(pool.kwargs, dict) else {}
        with self._lock:
            found = self._compiled.get(key)
            if found is None:
                checkpoints = ConnectionPool[Connection[DictRow]](
                    pool.conninfo,
                    min_size=1,
                    max_size=max(2, pool.max_size),
                    kwargs={
                        "autocommit": True,
                        "row_factory": dict_row,
                        "prepare_threshold": options.get("prepare_threshold", 5),
                    },
                    name="agent_runs-langgraph",
                    open=True,
                )
                saver = PostgresSaver(checkpoints)
                if isinstance(self._source, StateGraph):
                    compiled = self._source.compile(checkpointer=saver)
                else:
                    compiled = self._source(saver)
                found = self._compiled[key] = (checkpoints, compiled)
            return found[1]

    def close(self) -> None:
        """Close the checkpointers' connection pools (a later call opens them again)."""
        with self._lock:
            compiled, self._compiled = self._compiled, {}
        for checkpoints, _ in compiled.values():
            checkpoints.close()
