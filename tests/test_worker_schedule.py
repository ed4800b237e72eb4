"""A worker asleep on a run scheduled for later wakes for it when it becomes available, long
before its slow poll; a RetryableError's retry_after_seconds delays the next attempt."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, RunStatus, create_pool
from agent_runs.worker import AgentResult, RetryableError, RunContext, Worker
from tests.helpers import new_run, wait_until
from tests.test_worker_wakeups import POLL, Running, _listening_worker


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=1, max_size=6) as p:
        yield p


def test_a_listening_worker_wakes_for_a_scheduled_run_within_a_second(
    pool: ConnectionPool, dsn: str, repo: AgentRunRepository
) -> None:
    worker = _listening_worker(pool, dsn)
    with Running(worker):
        time.sleep(1.0)  # idle, asleep on its slow poll
        now = repo.conn.execute("SELECT now()").fetchone()
        assert now is not None
        run = new_run(repo, available_at=now[0] + timedelta(seconds=2))
        assert wait_until(
            lambda: (r := repo.get_run(run.id)) is not None and r.status == RunStatus.COMPLETED,
            timeout=10,
        )
    (attempt,) = repo.list_run_attempts(run.id)
    assert run.available_at is not None
    late = (attempt.started_at - run.available_at).total_seconds()
    assert 0 <= late <= 1.0, late


def test_retry_after_seconds_delays_the_next_attempt(
    pool: ConnectionPool, dsn: str, repo: AgentRunRepository
) -> None:
    calls: list[int] = []

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        calls.append(ctx.attempt_no)
        if ctx.attempt_no == 1:
            raise RetryableError("429 from the provider", retry_after_seconds=1.5)
        return AgentResult.completed()

    worker = Worker(pool, agent, name="later", lease_seconds=10, poll_seconds=POLL, listen_dsn=dsn)
    with Running(worker):
        run = new_run(repo)
        assert wait_until(
            lambda: (r := repo.get_run(run.id)) is not None and r.status == RunStatus.COMPLETED,
            timeout=15,
        )
    first, second = repo.list_run_attempts(run.id)
    assert first.outcome == "retry_released" and first.retry_at is not None
    assert first.finished_at is not None
    assert first.retry_at - first.finished_at == timedelta(seconds=1.5)
    assert first.retry_at <= second.started_at <= first.retry_at + timedelta(seconds=1)
