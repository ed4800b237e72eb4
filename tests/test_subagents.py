"""Sub-agent runs from an agent's context: lineage, ids derived so a retried parent finds the same
child, a child's own thread, and a wait that ends with the child, the parent's stop or a timeout."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, RunStatus, create_pool
from agent_runs.worker import AgentResult, RetryableError, RunContext, Worker
from tests.helpers import new_run, wait_until


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=1, max_size=10) as p:
        yield p


class Looping:
    """A worker's run_forever in `threads` threads, stopped (and joined) at exit."""

    def __init__(self, worker: Worker, threads: int) -> None:
        self.worker = worker
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=worker.run_forever, args=(self.stop,)) for _ in range(threads)
        ]

    def __enter__(self) -> Looping:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(15)
        self.worker.close()
        assert not any(t.is_alive() for t in self.threads)


def _worker(pool: ConnectionPool, agent: Any, **kwargs: Any) -> Worker:
    kwargs.setdefault("lease_seconds", 10)
    kwargs.setdefault("poll_seconds", 0.05)
    return Worker(pool, agent, name="subagents", **kwargs)


def tree_agent(run: AgentRun, ctx: RunContext) -> AgentResult:
    """Each run starts `fanout` children one level down and completes with their sum."""
    depth = int(run.input_payload.get("depth", 0))
    if depth == 0:
        return AgentResult.completed(output=1)
    children = [
        ctx.create_subagent_run(agent_slug="tree", input_payload={"depth": depth - 1})
        for _ in range(2)
    ]
    ended = [ctx.wait_for_run(child.id, 30) for child in children]
    assert all(child.status == RunStatus.COMPLETED for child in ended)
    return AgentResult.completed(output=1 + sum(child.output for child in ended))


def test_a_tree_of_sub_agents_runs_with_its_lineage(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    root = new_run(repo, agent_slug="tree", input_payload={"depth": 2})
    with Looping(_worker(pool, tree_agent), threads=8):
        wait_until(lambda: repo.get_run(root.id).is_terminal, timeout=30)  # type: ignore[union-attr]
    ended = repo.get_run(root.id)
    assert ended is not None and (ended.status, ended.output) == (RunStatus.COMPLETED, 7)
    runs = repo.list_runs(agent_slug="tree", limit=100)
    assert len(runs) == 7
    by_id = {r.id: r for r in runs}
    for run in runs:
        if run.id == root.id:
            continue
        parent = by_id[run.created_by_run_id]  # type: ignore[index]
        assert run.run_type == "subagent" and run.uid == parent.uid
        assert run.thread_id != parent.thread_id
        assert len(run.request_id) <= 64 and len(run.thread_id) <= 64
    assert sum(1 for r in runs if r.created_by_run_id == root.id) == 2


def test_a_retried_parent_finds_the_children_its_first_attempt_created(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    seen: list[tuple[int, str, str]] = []

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        first = ctx.create_subagent_run(agent_slug="nobody")
        keyed = ctx.create_subagent_run(agent_slug="nobody", key="summary")
        seen.extend([(ctx.attempt_no, first.id, keyed.id)])
        if ctx.attempt_no == 1:
            raise RetryableError("provider timeout")
        assert ctx.create_subagent_run(agent_slug="nobody", key="summary").id == keyed.id
        return AgentResult.completed()

    parent = new_run(repo, agent_slug="parent")
    worker = _worker(pool, agent, agent_slugs=["parent"])
    try:
        worker.run_once()
        worker.run_once()
    finally:
        worker.close()
    assert [attempt for attempt, _, _ in seen] == [1, 2]
    assert seen[0][1:] == seen[1][1:] and seen[0][1] != seen[0][2]
    children = [r for r in repo.list_runs(agent_slug="nobody") if r.created_by_run_id == parent.id]
    assert len(children) == 2


def test_the_wait_returns_the_child_as_it_is_once_the_parent_is_cancelled(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    waited: list[tuple[AgentRun, float]] = []

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        child = ctx.create_subagent_run(agent_slug="nobody")
        started = time.monotonic()
        waited.append((ctx.wait_for_run(child.id, 60), time.monotonic() - started))
        return AgentResult.completed()

    parent = new_run(repo, agent_slug="parent")
    with Looping(_worker(pool, agent, agent_slugs=["parent"], heartbeat_seconds=0.2), threads=1):
        wait_until(lambda: len(repo.list_runs(agent_slug="nobody")) == 1, timeout=10)
        time.sleep(0.3)
        repo.request_cancel(parent.id)
        wait_until(lambda: repo.get_run(parent.id).is_terminal, timeout=10)  # type: ignore[union-attr]
    [(child, seconds)] = waited
    assert child.status == RunStatus.PENDING and seconds < 10
    assert repo.get_run(parent.id).status == RunStatus.CANCELLED  # type: ignore[union-attr]


def test_the_wait_raises_timeout_error_at_its_timeout(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        child = ctx.create_subagent_run(agent_slug="nobody")
        started = time.monotonic()
        try:
            ctx.wait_for_run(child.id, 0.3)
        except TimeoutError:
            return AgentResult.completed(output=round(time.monotonic() - started, 1))
        return AgentResult.failed("no_timeout", "the wait ended without its timeout")

    new_run(repo, agent_slug="parent")
    worker = _worker(pool, agent, agent_slugs=["parent"])
    try:
        ended = worker.run_once()
    finally:
        worker.close()
    assert ended is not None
    stored = repo.get_run(ended.id)
    assert stored is not None and stored.status == RunStatus.COMPLETED
    assert 0.3 <= stored.output < 2


def test_a_coroutine_agent_starts_and_awaits_a_sub_agent_through_the_same_context(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    async def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        if run.run_type == "subagent":
            return AgentResult.completed(output={"child_of": run.created_by_run_id})
        child = ctx.create_subagent_run(agent_slug="async-tree", input_payload={"n": 1})
        ended = await asyncio.to_thread(ctx.wait_for_run, child.id, 30)
        return AgentResult.completed(output=ended.output)

    parent = new_run(repo, agent_slug="async-tree")
    with Looping(_worker(pool, agent), threads=2):
        wait_until(lambda: repo.get_run(parent.id).is_terminal, timeout=30)  # type: ignore[union-attr]
    ended = repo.get_run(parent.id)
    assert ended is not None and ended.status == RunStatus.COMPLETED
    assert ended.output == {"child_of": parent.id}
