"""The worker's data flows one way, measured on a running worker: while real runs go from their
claim to their committed end (claim source, executing threads, writer, the slots given back),
every call from one of the worker package's modules into another is recorded. A call into a
module that imports the caller (directly or through others) goes back up the package: the data
came back to a module it had left. There are at most five such calls, each named on failure."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, create_pool
from agent_runs.worker import AgentResult, RunContext, Worker
from tests.helpers import new_run, wait_until
from tests.test_worker_imports import PACKAGE, _package_sources, graph_of

COMEBACKS = 5
THREADS = 2
RUNS = 6

Edge = tuple[str, str]


def _module(frame: FrameType | None) -> str | None:
    """The worker module `frame` runs in (its short name), or None outside the package."""
    if frame is None:
        return None
    name = frame.f_globals.get("__name__", "")
    if not isinstance(name, str) or not name.startswith(PACKAGE + "."):
        return None
    return name.removeprefix(PACKAGE + ".").split(".")[0]


class CallEdges:
    """Every (caller module, callee module) pair of the worker package seen in any thread."""

    def __init__(self) -> None:
        self.edges: set[Edge] = set()
        self._lock = threading.Lock()

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        callee = _module(frame)
        if callee is None:
            return
        caller = frame.f_back
        # A call from outside the package made by package code lower down (a callback passed
        # to threading or psycopg) is charged to the nearest package frame above it.
        while caller is not None and _module(caller) is None:
            caller = caller.f_back
        source = _module(caller)
        if source is not None and source != callee:
            with self._lock:
                self.edges.add((source, callee))

    def __enter__(self) -> CallEdges:
        threading.setprofile(self.profile)
        sys.setprofile(self.profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


def below(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Module -> every module it imports, directly or through others."""
    reach: dict[str, set[str]] = {}

    def walk(name: str) -> set[str]:
        if name not in reach:
            reach[name] = set()
            for other in graph.get(name, set()):
                reach[name] |= {other} | walk(other)
        return reach[name]

    for name in graph:
        walk(name)
    return reach


def comebacks(edges: set[Edge], graph: dict[str, set[str]]) -> list[Edge]:
    """The calls that go into a module importing their caller: back up the package."""
    reach = below(graph)
    return sorted((caller, callee) for caller, callee in edges if caller in reach.get(callee, ()))


def _completed(run: AgentRun, ctx: RunContext) -> AgentResult:
    return AgentResult.completed()


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=2, max_size=THREADS + 3) as p:
        yield p


@pytest.mark.parametrize("completion", ["durable", "async"])
def test_a_run_from_claim_to_committed_end_comes_back_up_the_package_at_most_five_times(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    observer: psycopg.Connection[Any],
    completion: str,
) -> None:
    for _ in range(RUNS):
        new_run(repo)
    worker = Worker(pool, _completed, poll_seconds=0.05, completion=completion)
    stop = threading.Event()
    with CallEdges() as seen:
        loops = [threading.Thread(target=worker.run_forever, args=(stop,)) for _ in range(THREADS)]
        for loop in loops:
            loop.start()
        try:
            done = "SELECT count(*) FROM agent_runs WHERE status = 'completed'"
            wait_until(lambda: observer.execute(done).fetchone() == (RUNS,), timeout=60)
        finally:
            stop.set()
            for loop in loops:
                loop.join(10)
            worker.close()
    assert not any(loop.is_alive() for loop in loops)
    graph = graph_of(_package_sources())
    # The trace saw the run's whole way: claimed, executed, written.
    modules = {module for edge in seen.edges for module in edge}
    assert {"claimer", "executor", "flusher"} <= modules, sorted(seen.edges)
    back = comebacks(seen.edges, graph)
    assert len(back) <= COMEBACKS, back


def test_a_call_into_a_module_that_imports_the_caller_counts_as_coming_back() -> None:
    graph = {"runtime": {"loop"}, "loop": {"executor"}, "executor": {"lease"}, "lease": set()}
    edges = {("runtime", "loop"), ("loop", "executor"), ("executor", "lease"), ("lease", "loop")}
    edges.add(("executor", "runtime"))
    assert comebacks(edges, graph) == [("executor", "runtime"), ("lease", "loop")]
    assert comebacks({("runtime", "lease")}, graph) == []
