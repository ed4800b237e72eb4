"""The writer's refill: a batch of durable ends and the next runs of the slots it frees share one
statement and one commit (finish_runs_and_claim), with every rule of finish_runs and
claim_next_attempts, never more runs held than threads, and lost replies confirmed."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, Finish, RunStatus, create_pool
from agent_runs.worker import AgentResult, RunContext, Worker
from tests.helpers import OWNER, at, new_run, wait_until

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


def _drain(worker: Worker, observer: Conn, runs: int, threads: int = THREADS) -> None:
    stop = threading.Event()
    loops = [threading.Thread(target=worker.run_forever, args=(stop,)) for _ in range(threads)]
    for loop in loops:
        loop.start()
    try:
        finished = "SELECT count(*) FROM agent_runs WHERE status = 'completed'"
        wait_until(lambda: _count(observer, finished) == runs, timeout=60)
    finally:
        stop.set()
        for loop in loops:
            loop.join(10)
    assert not any(loop.is_alive() for loop in loops)


# --- the statement -------------------------------------------------------------------------------


def test_finishes_the_batch_then_claims_the_oldest_runs_for_as_many_slots_as_it_finished(
    repo: AgentRunRepository, t0: datetime
) -> None:
    for _ in range(3):
        new_run(repo)
    held = repo.claim_next_attempts(worker_ids=["a:1", "b:2", "c:3"], lease_seconds=30, now=t0)
    waiting = [new_run(repo) for _ in range(4)]
    finishes = [Finish(c.run.id, c.run.worker_id or "", "completed") for c in held]
    finishes[1] = Finish(held[1].run.id, "not-the-owner", "completed")  # refused
    finished, claimed = repo.finish_runs_and_claim(
        finishes, worker_ids=["n:1", "n:2", "n:3"], lease_seconds=30, now=at(t0, 5)
    )
    assert finished == {held[0].run.id: at(t0, 5), held[2].run.id: at(t0, 5)}
    # Two ends written: two runs claimed (the refused end keeps its slot), oldest first.
    assert [c.run.id for c in claimed] == [r.id for r in waiting[:2]]
    assert [c.run.worker_id for c in claimed] == ["n:1", "n:2"]
    for c in claimed:
        assert c.attempt_no == 1 and c.run == repo.get_run(c.run.id)
        assert c.run.status == RunStatus.RUNNING and c.run.lease_expires_at == at(t0, 35)
    for c in held[0], held[2]:
        (attempt,) = repo.list_run_attempts(c.run.id)
        assert attempt.outcome == "completed" and attempt.finished_at == at(t0, 5)
    refused = repo.get_run(held[1].run.id)
    assert refused is not None and refused.status == RunStatus.RUNNING


def test_worker_ids_beyond_the_ends_claim_for_slots_already_free(
    repo: AgentRunRepository, t0: datetime
) -> None:
    for _ in range(2):
        new_run(repo)
    held = repo.claim_next_attempts(worker_ids=["a:1", "b:2"], lease_seconds=30, now=t0)
    waiting = [new_run(repo) for _ in range(5)]
    finishes = [Finish(held[0].run.id, held[0].run.worker_id or "", "completed")]
    finishes.append(Finish(held[1].run.id, "not-the-owner", "completed"))  # refused
    finished, claimed = repo.finish_runs_and_claim(
        finishes, worker_ids=["n:1", "n:2", "n:3", "n:4"], lease_seconds=30, now=at(t0, 5)
    )
    assert finished == {held[0].run.id: at(t0, 5)}
    # Four slots offered, one of them the refused end's: three runs claimed, oldest first.
    assert [c.run.id for c in claimed] == [r.id for r in waiting[:3]]
    assert [c.run.worker_id for c in claimed] == ["n:1", "n:2", "n:3"]
    # More refused ends than worker ids: nothing claimed.
    other = new_run(repo)
    assert repo.finish_runs_and_claim(
        [Finish(held[1].run.id, "not-the-owner", "completed"), Finish(other.id, "x", "failed")],
        worker_ids=["n:5"],
        lease_seconds=30,
    ) == ({}, [])


def test_with_nothing_claimable_it_answers_the_ends_alone(
    repo: AgentRunRepository, t0: datetime
) -> None:
    new_run(repo)
    (held,) = repo.claim_next_attempts(worker_ids=[OWNER], lease_seconds=30, now=t0)
    finished, claimed = repo.finish_runs_and_claim(
        [Finish(held.run.id, OWNER, "failed", "boom", "it broke")],
        worker_ids=["n:1"],
        lease_seconds=30,
        now=at(t0, 1),
    )
    assert finished == {held.run.id: at(t0, 1)} and claimed == []
    stored = repo.get_run(held.run.id)
    assert stored is not None and stored.status == RunStatus.FAILED
    assert (stored.error_type, stored.error_message) == ("boom", "it broke")
    # Nothing written either: no run claimed, no end answered.
    assert repo.finish_runs_and_claim(
        [Finish(held.run.id, OWNER, "completed")], worker_ids=["n:2"], lease_seconds=30
    ) == ({}, [])


# --- the worker ----------------------------------------------------------------------------------


def test_a_durable_drain_claims_each_slots_next_run_in_the_commit_of_its_end(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    observer: Conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only a slot's first run comes from a claim of its own; every later one is claimed in the
    statement that writes the end before it."""
    runs = [new_run(repo).id for _ in range(8 * THREADS)]
    alone: list[int] = []  # runs claimed by a claim statement of their own
    single, batch = AgentRunRepository.claim_next_attempt, AgentRunRepository.claim_next_attempts

    def claim_one(self: AgentRunRepository, **kwargs: Any) -> Any:
        claimed = single(self, **kwargs)
        alone.append(claimed is not None)
        return claimed

    def claim_many(self: AgentRunRepository, **kwargs: Any) -> Any:
        claimed = batch(self, **kwargs)
        alone.append(len(claimed))
        return claimed

    monkeypatch.setattr(AgentRunRepository, "claim_next_attempt", claim_one)
    monkeypatch.setattr(AgentRunRepository, "claim_next_attempts", claim_many)
    with Worker(pool, _completed, lease_seconds=30, poll_seconds=0.05) as worker:
        _drain(worker, observer, len(runs))
        assert worker.flusher.items == len(runs)
    assert sum(alone) <= THREADS
    assert _facts(observer) == {("completed", 1, "completed", 1)}


def test_async_completion_claims_apart_from_the_ends(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    observer: Conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With async completion a slot comes back at the hand-over: no claim waits for an end."""
    runs = [new_run(repo).id for _ in range(4 * THREADS)]

    def refused(self: AgentRunRepository, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("async completion claims with the ends")

    monkeypatch.setattr(AgentRunRepository, "finish_runs_and_claim", refused)
    with Worker(pool, _completed, lease_seconds=30, poll_seconds=0.05, completion="async") as w:
        _drain(w, observer, len(runs))
    assert _facts(observer) == {("completed", 1, "completed", 1)}


def test_a_refill_whose_reply_is_lost_is_confirmed_and_its_claims_found(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    observer: Conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runs = [new_run(repo).id for _ in range(4 * THREADS)]
    lost: list[str] = []
    real = AgentRunRepository.finish_runs_and_claim

    def lose_the_first_reply(self: AgentRunRepository, *args: Any, **kwargs: Any) -> Any:
        finished, claimed = real(self, *args, **kwargs)
        if claimed and not lost:  # committed, never reported
            lost.extend(c.run.id for c in claimed)
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return finished, claimed

    monkeypatch.setattr(AgentRunRepository, "finish_runs_and_claim", lose_the_first_reply)
    with Worker(pool, _completed, lease_seconds=30, poll_seconds=0.05) as worker:
        _drain(worker, observer, len(runs))
    assert lost and set(lost) <= set(runs)
    # Each end confirmed, each claim found and executed once: nothing expired, nothing twice.
    assert _facts(observer) == {("completed", 1, "completed", 1)}


def test_runs_a_refill_brings_back_after_a_stop_request_are_released_for_retry(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    observer: Conn,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first, second = new_run(repo), new_run(repo)
    sent, go_on = threading.Event(), threading.Event()
    real = AgentRunRepository.finish_runs_and_claim

    def stopped_meanwhile(self: AgentRunRepository, *args: Any, **kwargs: Any) -> Any:
        sent.set()
        assert go_on.wait(20)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(AgentRunRepository, "finish_runs_and_claim", stopped_meanwhile)
    executed: list[str] = []

    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        executed.append(run.id)
        return AgentResult.completed()

    with Worker(pool, agent, lease_seconds=30, poll_seconds=0.05) as worker:
        stop = threading.Event()
        loop = threading.Thread(target=worker.run_forever, args=(stop,))
        loop.start()
        assert sent.wait(10)
        worker.request_stop()  # the refill is under way: what it claims, nobody will execute
        go_on.set()
        loop.join(10)
        assert not loop.is_alive()
    assert executed == [first.id]
    done, released = repo.get_run(first.id), repo.get_run(second.id)
    assert done is not None and done.status == RunStatus.COMPLETED
    assert released is not None and released.status == RunStatus.PENDING
    (attempt,) = repo.list_run_attempts(second.id)
    assert attempt.outcome == "retry_released"
