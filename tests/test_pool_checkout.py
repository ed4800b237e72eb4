"""The pool's checkout check: a pooled connection is checked only when it may have died (idle
for long), replaced when dead, and its dead siblings replaced before the next renewal."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, create_pool
from agent_runs import db as agent_runs_db
from agent_runs.worker.heartbeat import HeartbeatService

Conn = psycopg.Connection[Any]
OWNER = "lean-worker:1"


def _create(repo: AgentRunRepository, key: str) -> AgentRun:
    return repo.create_run(thread_id=key, agent_slug="a", uid="u", request_id=key)


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
