"""run_forever's claimer: one statement for the free slots, never more runs held than threads,
lost claim replies found again, and runs no thread will take released for retry."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, RunStatus, create_pool
from agent_runs.worker import AgentResult, RunContext, Worker
from tests.helpers import new_run, wait_until

Conn = psycopg.Connection[Any]
THREADS = 3


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=2, max_size=THREADS + 3) as p:
        yield p


def _completed(run: AgentRun, ctx: RunContext) -> AgentResult:
    return AgentResult.completed()


def _count(observer: Conn, sql: str) -> int:
    row = observer.execute(sql).fetchone()
    assert row is not None
    return int(row[0])


def _facts(observer: Conn) -> set[tuple[Any, ...]]:
    rows = observer.execute(
        "SELECT r.status, count(a.id), min(a.outcome), max(a.attempt_no)"
        " FROM agent_runs r JOIN agent_run_attempts a ON a.run_id = r.id GROUP BY r.id"
    ).fetchall()
    return set(rows)


def _slow_finishes(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """Every finish_runs statement (alone, or with the next claims) waits `seconds` first."""
    for name in ("finish_runs", "finish_runs_and_claim"):
        real = getattr(AgentRunRepository, name)

        def slow_finish(
            self: AgentRunRepository, *args: Any, _real: Any = real, **kwargs: Any
        ) -> Any:
            time.sleep(seconds)
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(AgentRunRepository, name, slow_finish)


class Looping:
    """`threads` threads in worker.run_forever, stopped (and joined) at exit."""

    def __init__(self, worker: Worker, threads: int = THREADS) -> None:
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
            thread.join(10)
        assert not any(t.is_alive() for t in self.threads)


def test_run_forever_holds_no_more_runs_than_threads_until_their_ends_commit(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    observer: Conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The threads do not wait for their ends to be written, but their slots do: with slow
    finish statements, no more runs are running at once than there are threads."""
    runs = [new_run(repo).id for _ in range(4 * THREADS)]
    _slow_finishes(monkeypatch, 0.3)
    most = 0
    with Worker(pool, _completed, lease_seconds=30, poll_seconds=0.05) as worker:
        with Looping(worker):

            def done() -> bool:
                nonlocal most
                running = "SELECT count(*) FROM agent_runs WHERE status = 'running'"
                most = max(most, _count(observer, running))
                finished = "SELECT count(*) FROM agent_runs WHERE finished_at IS NOT NULL"
                return _count(observer, finished) == len(runs)

            wait_until(done, timeout=60)
        assert worker.flusher.items == len(runs)
    assert 0 < most <= THREADS
    assert _facts(observer) == {("completed", 1, "completed", 1)}


def test_a_claim_whose_reply_is_lost_is_found_by_its_owner_tokens(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    observer: Conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs = [new_run(repo).id for _ in range(THREADS)]
    lost: list[str] = []
    single, batch = AgentRunRepository.claim_next_attempt, AgentRunRepository.claim_next_attempts

    def lose_the_first_reply(claimed: list[str]) -> None:
        if not lost:
            lost.extend(claimed)
            raise psycopg.OperationalError("server closed the connection unexpectedly")

    def claim_one(self: AgentRunRepository, **kwargs: Any) -> Any:
        claimed = single(self, **kwargs)
        lose_the_first_reply([claimed.run.id] if claimed is not None else [])
        return claimed

    def claim_many(self: AgentRunRepository, **kwargs: Any) -> Any:
        claimed = batch(self, **kwargs)
        lose_the_first_reply([c.run.id for c in claimed])
        return claimed

    monkeypatch.setattr(AgentRunRepository, "claim_next_attempt", claim_one)
    monkeypatch.setattr(AgentRunRepository, "claim_next_attempts", claim_many)
    worker = Worker(pool, _completed, lease_seconds=30, poll_seconds=0.05)
    with worker, Looping(worker):
        finished = "SELECT count(*) FROM agent_runs WHERE status = 'completed'"
        wait_until(lambda: _count(observer, finished) == len(runs), timeout=30)
    assert lost and set(lost) <= set(runs)
    # Each run found again and executed once: one attempt, completed, nothing expired.
    assert _facts(observer) == {("completed", 1, "completed", 1)}


def test_a_run_claimed_after_every_thread_left_is_released_for_retry(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    observer: Conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The claim statement is under way when the last run_forever thread stops: the run it
    brings back is released at once, not left to expire as if its worker had died."""
    run = new_run(repo)
    sent = threading.Event()
    go_on = threading.Event()
    single = AgentRunRepository.claim_next_attempt

    def claim_after_the_threads_left(self: AgentRunRepository, **kwargs: Any) -> Any:
        sent.set()
        assert go_on.wait(20)
        return single(self, **kwargs)

    monkeypatch.setattr(AgentRunRepository, "claim_next_attempt", claim_after_the_threads_left)
    executed: list[str] = []

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        executed.append(run.id)
        return AgentResult.completed()

    with Worker(pool, agent, lease_seconds=30, poll_seconds=0.05) as worker:
        with Looping(worker, threads=1):
            assert sent.wait(10)
        go_on.set()  # the thread has left: the claim now brings back a run nobody will take
        # Released now, by the claimer (close() would release it too, later).
        released = "SELECT count(*) FROM agent_run_attempts WHERE outcome = 'retry_released'"
        wait_until(lambda: _count(observer, released) == 1, timeout=10)
    assert executed == []
    stored = repo.get_run(run.id)
    assert stored is not None and stored.status == RunStatus.PENDING and stored.worker_id is None
    (attempt,) = repo.list_run_attempts(run.id)
    assert attempt.outcome == "retry_released" and attempt.finished_at is not None


def test_run_forever_ends_when_its_pool_is_closed(dsn: str, repo: AgentRunRepository) -> None:
    new_run(repo)
    pool = create_pool(dsn, min_size=1, max_size=3)
    worker = Worker(pool, _completed, lease_seconds=30, poll_seconds=0.05)
    stop = threading.Event()  # never set: only the closed pool ends the threads
    threads = [threading.Thread(target=worker.run_forever, args=(stop,)) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        wait_until(lambda: worker.claimer.items == 1)
        pool.close()
        for thread in threads:
            thread.join(10)
        assert not any(t.is_alive() for t in threads)
    finally:
        stop.set()
        worker.close()
        pool.close()


def test_run_forever_returns_once_the_ends_it_handed_over_are_written(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    observer: Conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Durable: a caller that stops its thread and closes its pool loses no end."""
    run = new_run(repo)
    _slow_finishes(monkeypatch, 0.5)
    executed = threading.Event()

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        executed.set()
        return AgentResult.completed()

    worker = Worker(pool, agent, lease_seconds=30, poll_seconds=0.05)
    try:
        with Looping(worker, threads=1) as looping:
            assert executed.wait(10)
            looping.stop.set()
            looping.threads[0].join(10)
            # Returned: the end is written, not still waiting for the writer thread.
            stored = repo.get_run(run.id)
            assert stored is not None and stored.status == RunStatus.COMPLETED
    finally:
        worker.close()
    assert _facts(observer) == {("completed", 1, "completed", 1)}


def test_a_thread_whose_stop_is_set_gets_no_more_runs(
    pool: ConnectionPool, repo: AgentRunRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its slot is not claimed for while it is still on its way out: no attempt is spent on a
    run it would only give back."""
    stop = threading.Event()
    answered, go_on = threading.Event(), threading.Event()
    sent_after_stop: list[str] = []
    single = AgentRunRepository.claim_next_attempt

    def claim(self: AgentRunRepository, **kwargs: Any) -> Any:
        if stop.is_set():
            sent_after_stop.append(kwargs["worker_id"])
        claimed = single(self, **kwargs)
        if not answered.is_set():  # the first poll found nothing: its answer is held back
            answered.set()
            assert go_on.wait(20)
        return claimed

    monkeypatch.setattr(AgentRunRepository, "claim_next_attempt", claim)
    worker = Worker(pool, _completed, lease_seconds=30, poll_seconds=0.05)
    try:
        thread = threading.Thread(target=worker.run_forever, args=(stop,))
        thread.start()
        # Stopped between two polls, never during one: a claim already sent when the stop is
        # set may bring back a run, which is then released (an attempt spent).
        assert answered.wait(10)
        stop.set()
        run = new_run(repo)  # claimable while the thread is still leaving
        go_on.set()
        thread.join(10)
        assert not thread.is_alive()
    finally:
        worker.close()
    stored = repo.get_run(run.id)
    assert stored is not None and stored.status == RunStatus.PENDING
    assert repo.list_run_attempts(run.id) == []
    assert sent_after_stop == [] and worker.claimer.batches == 1


def test_the_claimer_thread_ends_when_no_run_forever_thread_is_left(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    run = new_run(repo)

    def claimers() -> int:
        return sum(t.name == "agent-runs-claimer" for t in threading.enumerate())

    with Worker(pool, _completed, lease_seconds=30, poll_seconds=0.05) as worker:
        with Looping(worker, threads=2):
            wait_until(lambda: repo.get_run(run.id).status == RunStatus.COMPLETED)  # type: ignore[union-attr]
            assert claimers() == 1
        wait_until(lambda: claimers() == 0)
        again = new_run(repo)  # a new run_forever thread starts a claimer again
        with Looping(worker, threads=1):
            wait_until(lambda: repo.get_run(again.id).status == RunStatus.COMPLETED)  # type: ignore[union-attr]


def test_a_thread_stopping_while_it_executes_leaves_the_others_their_runs(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    """Scaling down by one thread while it runs a long agent: the threads that go on still
    get new runs at once."""
    started, release = threading.Event(), threading.Event()
    long_run = new_run(repo, input_payload={"long": True})

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        if (run.input_payload or {}).get("long"):
            started.set()
            assert release.wait(30)  # ignores should_stop, like a long model call
        return AgentResult.completed()

    def status(run_id: str) -> RunStatus | None:
        stored = repo.get_run(run_id)
        return None if stored is None else stored.status

    worker = Worker(pool, agent, lease_seconds=30, poll_seconds=0.05)
    stops = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=worker.run_forever, args=(stop,)) for stop in stops]
    try:
        threads[0].start()
        # Its agent has started, not only its claim committed: a run claimed and not yet started
        # when the stop is set goes to the other thread instead, which this test is not about.
        assert started.wait(10)
        threads[1].start()
        stops[0].set()  # the first thread leaves once its long run is done
        other = new_run(repo)
        wait_until(lambda: status(other.id) == RunStatus.COMPLETED)
        assert status(long_run.id) == RunStatus.RUNNING
    finally:
        release.set()
        for stop in stops:
            stop.set()
        for thread in threads:
            thread.join(10)
        worker.close()
    assert status(long_run.id) == RunStatus.COMPLETED
