"""The worker's lean path: a claim that answers its attempt_no, pooled connections checked only
when they may have died, time-ordered keys for new runs."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, RunStatus, create_pool
from agent_runs import db as agent_runs_db
from agent_runs.ids import new_run_id
from agent_runs.worker import AgentResult, RunContext, Worker
from agent_runs.worker.heartbeat import HeartbeatService

Conn = psycopg.Connection[Any]
OWNER = "lean-worker:1"


def _create(repo: AgentRunRepository, key: str) -> AgentRun:
    return repo.create_run(thread_id=key, agent_slug="a", uid="u", request_id=key)


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=1, max_size=2) as p:
        yield p


# --- claim_next_attempt ------------------------------------------------------------------------


def test_claim_next_attempt_answers_the_attempt_it_opened(
    repo: AgentRunRepository, t0: datetime
) -> None:
    assert repo.claim_next_attempt(worker_id=OWNER, lease_seconds=30, now=t0) is None
    run = _create(repo, "r1")
    claimed = repo.claim_next_attempt(worker_id=OWNER, lease_seconds=30, now=t0)
    assert claimed is not None
    got, attempt_no = claimed
    assert got == repo.get_run(run.id) and got.status == RunStatus.RUNNING
    assert attempt_no == 1
    opened = repo.get_open_attempt(run.id)
    assert opened is not None and (opened.attempt_no, opened.worker_id) == (1, OWNER)

    assert repo.release_lease_for_retry(run.id, worker_id=OWNER, now=t0 + timedelta(seconds=1))
    again = repo.claim_next_attempt(
        worker_id="other:2", lease_seconds=30, now=t0 + timedelta(seconds=2)
    )
    assert again is not None and again[1] == 2 and again[0].worker_id == "other:2"


def test_claim_next_attempt_after_an_expired_lease_counts_the_expired_attempt(
    repo: AgentRunRepository, t0: datetime
) -> None:
    run = _create(repo, "r1")
    assert repo.claim_next_attempt(worker_id=OWNER, lease_seconds=1, now=t0) is not None
    assert repo.request_cancel(run.id, now=t0) is not None  # running -> cancel_requested
    assert repo.reconcile_expired_leases(now=t0 + timedelta(seconds=5))
    # An ownerless cancel_requested run is claimable again; its claim opens attempt 2 or the
    # reconciler ended it: either way the answer matches the open attempt.
    claimed = repo.claim_next_attempt(
        worker_id="w:2", lease_seconds=30, now=t0 + timedelta(seconds=6)
    )
    opened = repo.get_open_attempt(run.id)
    if claimed is None:
        assert opened is None
    else:
        assert opened is not None and claimed[1] == opened.attempt_no


def test_claim_next_keeps_its_public_return_type(repo: AgentRunRepository, t0: datetime) -> None:
    run = _create(repo, "r1")
    claimed = repo.claim_next(worker_id=OWNER, lease_seconds=30, now=t0)
    assert isinstance(claimed, AgentRun) and claimed.id == run.id


# --- the worker ------------------------------------------------------------------------------


def _recording_agent(seen: list[int]) -> Any:
    def agent(run: AgentRun, ctx: RunContext) -> AgentResult:
        seen.append(ctx.attempt_no)
        return AgentResult.completed()

    return agent


def test_the_worker_does_not_read_the_open_attempt_after_a_claim(
    pool: ConnectionPool, repo: AgentRunRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = _create(repo, "r1")

    def refuse(self: AgentRunRepository, run_id: str) -> None:
        raise AssertionError("a second round trip after the claim")

    monkeypatch.setattr(AgentRunRepository, "get_open_attempt", refuse)
    seen: list[int] = []
    with Worker(pool, _recording_agent(seen), name="lean", lease_seconds=30) as worker:
        ended = worker.run_once()
    assert ended is not None and ended.status == RunStatus.COMPLETED
    assert seen == [1]
    attempts = repo.list_run_attempts(run.id)
    assert [(a.attempt_no, a.outcome) for a in attempts] == [(1, "completed")]


def test_a_claim_whose_reply_is_lost_is_found_and_executed_with_its_attempt(
    pool: ConnectionPool, repo: AgentRunRepository, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim commits in the real database; only its answer never reaches the worker."""
    run = _create(repo, "r1")
    real = AgentRunRepository.claim_next_attempt
    lost: list[str] = []

    def claim_then_lose_the_reply(self: AgentRunRepository, **kwargs: Any) -> Any:
        claimed = real(self, **kwargs)
        if claimed is not None and not lost:
            lost.append(claimed[0].id)
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return claimed

    monkeypatch.setattr(AgentRunRepository, "claim_next_attempt", claim_then_lose_the_reply)
    seen: list[int] = []
    with Worker(pool, _recording_agent(seen), name="lean", lease_seconds=30) as worker:
        ended = worker.run_once()
    assert lost == [run.id]
    assert ended is not None and ended.status == RunStatus.COMPLETED
    assert seen == [1]
    assert [a.outcome for a in repo.list_run_attempts(run.id)] == ["completed"]


# --- the pool's checkout check ---------------------------------------------------------------


def _backend_pid(conn: Conn) -> int:
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(row[0])


def test_a_connection_idle_for_long_is_checked_and_replaced_when_dead(
    dsn: str, observer: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_runs_db, "RECENT_RETURN_SECONDS", 0.0)
    with create_pool(dsn, min_size=1, max_size=1) as pool:
        with pool.connection() as conn:
            pid = _backend_pid(conn)
        observer.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pool.connection(timeout=10) as conn:
            assert _backend_pid(conn) != pid


def test_a_connection_returned_just_now_is_handed_out_without_a_check(
    dsn: str, observer: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the round trip a connection that died since its return fails its next call;
    the pool then discards it and the caller's retry gets a live one."""
    monkeypatch.setattr(agent_runs_db, "RECENT_RETURN_SECONDS", 3600.0)
    with create_pool(dsn, min_size=1, max_size=1) as pool:
        with pool.connection() as conn:
            pid = _backend_pid(conn)
        observer.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pytest.raises(psycopg.OperationalError), pool.connection(timeout=10) as conn:
            _backend_pid(conn)
        with pool.connection(timeout=10) as conn:
            assert _backend_pid(conn) != pid


def test_a_connection_given_back_is_in_the_pool_when_putconn_returns(dsn: str) -> None:
    """create_pool notes a return in the returning thread: no hand-over to the pool's worker
    threads (a thread switch per call) before the connection can be handed out again."""
    with create_pool(dsn, min_size=1, max_size=1) as pool:
        pool.wait()
        for _ in range(20):
            conn = pool.getconn()
            pool.putconn(conn)
            assert pool.get_stats()["pool_available"] == 1


def test_an_explicit_check_is_kept(dsn: str, observer: Conn) -> None:
    with create_pool(dsn, min_size=1, max_size=1, check=ConnectionPool.check_connection) as pool:
        with pool.connection() as conn:
            pid = _backend_pid(conn)
        observer.execute("SELECT pg_terminate_backend(%s)", (pid,))
        with pool.connection(timeout=10) as conn:
            assert _backend_pid(conn) != pid


def test_a_dead_pooled_connection_gets_its_dead_siblings_replaced_before_the_next_renewal(
    dsn: str, repo: AgentRunRepository, observer: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Backends terminated while idle in the pool, all returned moments ago (so handed out
    without a check): the heartbeat round that meets the first dead one fails, and the next
    round renews on a live connection instead of meeting the next dead one."""
    monkeypatch.setattr(agent_runs_db, "RECENT_RETURN_SECONDS", 3600.0)
    run = _create(repo, "r1")
    assert repo.claim_next_attempt(worker_id=OWNER, lease_seconds=30) is not None
    with create_pool(dsn, min_size=4, max_size=4) as pool:
        pool.wait()
        held = [pool.getconn() for _ in range(4)]
        pids = [_backend_pid(conn) for conn in held]
        for conn in held:
            pool.putconn(conn)
        heartbeat = HeartbeatService(pool, lease_seconds=30, interval=3600, timeout=5)
        try:
            lease = heartbeat.track(run.id, OWNER, deadline=time.monotonic() + 30)
            observer.execute("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) pid", (pids,))
            assert heartbeat.renew_once() is False
            assert heartbeat.renew_once() is True
        finally:
            heartbeat.close()
    assert not lease.lost and heartbeat.failed_rounds == 1


# --- keys of new runs ------------------------------------------------------------------------


def test_new_run_ids_are_uuid7_ordered_by_time(repo: AgentRunRepository) -> None:
    ids = [new_run_id() for _ in range(200)]
    assert len(set(ids)) == len(ids)
    for value in ids:
        parsed = uuid.UUID(value)
        assert parsed.version == 7 and parsed.variant == uuid.RFC_4122
        assert str(parsed) == value
    millis = [uuid.UUID(v).int >> 80 for v in ids]
    assert millis == sorted(millis)
    run = _create(repo, "r1")
    assert uuid.UUID(run.id).version == 7
    assert uuid.UUID(run.id).int >> 80 >= millis[-1]


def test_a_given_run_id_is_kept(repo: AgentRunRepository) -> None:
    given = str(uuid.uuid4())
    run = repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r", run_id=given)
    assert run.id == given
