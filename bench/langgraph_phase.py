"""What a checkpointed LangGraph step costs next to an attempt (agent_runs[langgraph]).

Three prices, one client each, on one database: an attempt's own writes (claim_next, then
set_terminal_status: what agent_runs adds per execution), a superstep of a no-op node with
PostgresSaver and durability="sync" (what a durable step adds: its checkpoint and writes,
committed before the next step starts), and the same superstep with no checkpointer
(LangGraph's own cost). A step's price is the difference between a 12-step and a 2-step graph,
divided by 10: the graph's start and end are left out. One model call takes 300 ms to seconds.
"""

from __future__ import annotations

import operator
import statistics
import time
import uuid
from typing import Annotated, Any, Final, TypedDict

import agent_runs
from agent_runs import AgentRunRepository, RunStatus
from bench import seed
from bench.workload import LEASE_SECONDS, new_worker_id

LONG: Final = 12
SHORT: Final = 2


class _State(TypedDict, total=False):
    steps: Annotated[list[int], operator.add]


def _graph(length: int, checkpointer: Any) -> Any:
    from langgraph.graph import END, START, StateGraph

    graph = StateGraph(_State)
    names = [f"n{i}" for i in range(length)]
    for i, name in enumerate(names):
        graph.add_node(name, lambda state, i=i: {"steps": [i]})
    for before, after in zip([START, *names], [*names, END], strict=True):
        graph.add_edge(before, after)
    return graph.compile(checkpointer=checkpointer)


def _per_step(url: str, rounds: int, *, durable: bool) -> float:
    """Seconds per superstep: (a LONG graph's run - a SHORT one's) / (LONG - SHORT), median."""
    from langgraph.checkpoint.postgres import PostgresSaver
    from psycopg import Connection
    from psycopg.rows import dict_row

    with Connection.connect(url, autocommit=True, row_factory=dict_row) as conn:
        saver = PostgresSaver(conn) if durable else None
        if saver is not None:
            saver.setup()
        graphs = {n: _graph(n, saver) for n in (LONG, SHORT)}
        samples = []
        for _ in range(rounds + 1):  # the first round warms up
            timed = {}
            for length, graph in graphs.items():
                config = {"configurable": {"thread_id": uuid.uuid4().hex}}
                started = time.perf_counter()
                if durable:
                    graph.invoke({"steps": []}, config, durability="sync")
                else:  # (langgraph 1.2 fails on durability="sync" without a checkpointer)
                    graph.invoke({"steps": []}, config)
                timed[length] = time.perf_counter() - started
            samples.append((timed[LONG] - timed[SHORT]) / (LONG - SHORT))
    return statistics.median(samples[1:])


def _per_attempt(url: str, attempts: int) -> float:
    """Seconds per attempt: claim_next, then set_terminal_status (completed), median."""
    with agent_runs.connect(url) as conn:
        repo = AgentRunRepository(conn)
        seed.seed_pending([conn], attempts + 5)
        samples = []
        for i in range(attempts + 5):
            worker = new_worker_id("repository", 0)
            started = time.perf_counter()
            run = repo.claim_next(worker_id=worker, lease_seconds=LEASE_SECONDS)
            assert run is not None
            ended = repo.set_terminal_status(run.id, status=RunStatus.COMPLETED, worker_id=worker)
            assert ended.changed
            if i >= 5:  # warm-up: statements prepared
                samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def run_phase(url: str, quick: bool) -> dict[str, Any]:
    rounds, attempts = (3, 20) if quick else (15, 300)
    durable = _per_step(url, rounds, durable=True)
    plain = _per_step(url, rounds, durable=False)
    attempt = _per_attempt(url, attempts)
    return {
        "rounds": rounds,
        "attempts": attempts,
        "step_checkpointed_ms": durable * 1000,
        "step_in_memory_ms": plain * 1000,
        "attempt_ms": attempt * 1000,
        "checkpoint_ms": (durable - plain) * 1000,
    }


def render_phase(result: dict[str, Any]) -> list[str]:
    """Human lines for the report."""
    return [
        f"langgraph: a checkpointed step next to an attempt (medians; {result['rounds']} rounds of "
        f"{LONG}- and {SHORT}-step graphs, {result['attempts']} attempts):",
        f"  superstep, PostgresSaver, durability=sync  {result['step_checkpointed_ms']:8.2f} ms",
        f"  superstep, no checkpointer                 {result['step_in_memory_ms']:8.2f} ms",
        f"  the checkpoint's share of a step           {result['checkpoint_ms']:8.2f} ms",
        f"  an attempt (claim_next + set_terminal)     {result['attempt_ms']:8.2f} ms",
        "  (one model call: 300 ms and more)",
    ]
