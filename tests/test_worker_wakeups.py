"""The worker wakes on NOTIFY: a new run is picked up at once, long before the safety-net poll."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, RunStatus, create_pool
from agent_runs.worker import AgentResult, RunContext, Worker
from tests.helpers import wait_until

POLL = 60.0  # far longer than any wait below: only a wake-up can explain a pickup


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=1, max_size=6) as p:
        yield p


def _completed(run: AgentRun | None) -> bool:
    return run is not None and run.status == RunStatus.COMPLETED


def _completion_of(repo: AgentRunRepository, run_id: str) -> Callable[[], bool]:
    return lambda: _completed(repo.get_run(run_id))


class Running:
    """A listening worker's run_forever on `threads` threads, stopped at exit."""

    def __init__(self, worker: Worker, threads: int = 2) -> None:
        self.worker = worker
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=worker.run_forever, args=(self.stop,)) for _ in range(threads)
        ]

    def __enter__(self) -> Running:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.worker.request_stop()
        for thread in self.threads:
            thread.join(timeout=10)
        self.worker.close()
        assert not any(t.is_alive() for t in self.threads)


def _wait_for_the_first_poll(worker: Worker) -> None:
    """The claimer's first statement has answered (nothing): a run created now is claimed only
    after a wake-up or the poll, whatever the machine's speed."""
    wait_until(lambda: worker.claimer.batches >= 1)


def _listening_worker(pool: ConnectionPool, dsn: str, **kwargs: Any) -> Worker:
    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        return AgentResult.completed()

    return Worker(
        pool, agent, name="woken", lease_seconds=10, poll_seconds=POLL, listen_dsn=dsn, **kwargs
    )


def test_a_listening_worker_picks_up_new_runs_without_waiting_for_its_poll(
    pool: ConnectionPool, dsn: str, repo: AgentRunRepository
) -> None:
    with Running(_listening_worker(pool, dsn)) as running:
        assert wait_until(lambda: running.worker.listening)
        _wait_for_the_first_poll(running.worker)
        for n in range(3):
            run = repo.create_run(thread_id=f"t{n}", agent_slug="a", uid="u", request_id=f"r{n}")
            assert wait_until(_completion_of(repo, run.id), timeout=5.0)


def test_a_worker_serving_other_slugs_is_not_woken(
    pool: ConnectionPool, dsn: str, repo: AgentRunRepository
) -> None:
    with Running(_listening_worker(pool, dsn, agent_slugs=["b"])) as running:
        assert wait_until(lambda: running.worker.listening)
        _wait_for_the_first_poll(running.worker)
        other = repo.create_run(thread_id="t1", agent_slug="a", uid="u", request_id="r1")
        mine = repo.create_run(thread_id="t2", agent_slug="b", uid="u", request_id="r2")
        assert wait_until(lambda: _completed(repo.get_run(mine.id)), timeout=5.0)
        assert repo.get_run(other.id).status == RunStatus.PENDING  # type: ignore[union-attr]
