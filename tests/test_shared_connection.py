"""Threads sharing one connection: calls take turns, every call that returns has committed (or
released its savepoint inside the caller's transaction), and the connection is left idle."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg import pq

import agent_runs
from agent_runs import AgentRunRepository, RunStatus

Conn = psycopg.Connection[Any]
LEASE = 30.0
THREADS = 8
ROUNDS = 12


def _run_threads(count: int, target: Callable[[int], None]) -> list[BaseException]:
    errors: list[BaseException] = []
    start = threading.Barrier(count)

    def body(n: int) -> None:
        try:
            start.wait(timeout=30)
            target(n)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=body, args=(n,)) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    return errors


def _lifecycle(repo: AgentRunRepository, n: int, i: int, committed: list[str]) -> None:
    key = f"{n}-{i}-{uuid.uuid4().hex[:8]}"
    worker = f"w{n}:1"
    run = repo.create_run(thread_id=f"t-{key}", agent_slug="a", uid="u", request_id=f"r-{key}")
    claim = repo.mark_running(run.id, worker_id=worker, lease_seconds=LEASE)
    assert claim.acquired
    assert repo.renew_lease(run.id, worker_id=worker, lease_seconds=LEASE)
    final = repo.set_terminal_status(run.id, status="completed", worker_id=worker)
    assert final.changed
    committed.append(run.id)


def _statuses(observer: Conn, ids: list[str]) -> dict[str, str]:
    rows = observer.execute("SELECT id, status FROM agent_runs WHERE id = ANY(%s)", (ids,))
    return {row[0]: row[1] for row in rows.fetchall()}


@pytest.mark.parametrize("repositories", ["one repository", "a repository per thread"])
def test_eight_threads_on_one_connection_all_commit(
    conn: Conn, observer: Conn, *, repositories: str
) -> None:
    shared = AgentRunRepository(conn)
    committed: list[str] = []

    def work(n: int) -> None:
        repo = shared if repositories == "one repository" else AgentRunRepository(conn)
        for i in range(ROUNDS):
            _lifecycle(repo, n, i, committed)
            assert repo.list_run_attempts(committed[-1])

    errors = _run_threads(THREADS, work)
    assert not errors, errors[:3]
    assert len(committed) == THREADS * ROUNDS
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    # Seen from another session: every call that returned had committed.
    assert set(_statuses(observer, committed).values()) == {"completed"}
    assert len(_statuses(observer, committed)) == THREADS * ROUNDS


def test_the_classic_path_shared_by_threads_commits_too(conn: Conn, observer: Conn) -> None:
    """With the one-round-trip path unavailable (client encoding), every call is a classic
    BEGIN … COMMIT of psycopg's: still whole, still committed."""
    conn.execute("SET client_encoding TO 'LATIN1'")
    repo = AgentRunRepository(conn)
    committed: list[str] = []

    def work(n: int) -> None:
        for i in range(4):
            _lifecycle(repo, n, i, committed)

    errors = _run_threads(THREADS, work)
    assert not errors, errors[:3]
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    assert set(_statuses(observer, committed).values()) == {"completed"}
    assert len(committed) == THREADS * 4


def test_a_failing_call_writes_nothing_and_the_others_go_on(conn: Conn, observer: Conn) -> None:
    repo = AgentRunRepository(conn)
    committed: list[str] = []
    busy: list[str] = []

    def work(n: int) -> None:
        for i in range(ROUNDS):
            _lifecycle(repo, n, i, committed)
            try:  # the same thread twice: refused, and nothing written
                for k in range(2):
                    repo.create_run(
                        thread_id=f"busy-{n}-{i}", agent_slug="a", uid="u", request_id=f"b{n}{i}{k}"
                    )
            except agent_runs.ThreadBusy:
                busy.append(f"b{n}{i}1")

    errors = _run_threads(THREADS, work)
    assert not errors, errors[:3]
    assert len(busy) == THREADS * ROUNDS
    found = observer.execute(
        "SELECT count(*) FROM agent_runs WHERE request_id = ANY(%s)", (busy,)
    ).fetchone()
    assert found == (0,)
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    assert set(_statuses(observer, committed).values()) == {"completed"}


def test_threads_sharing_pooled_connections(dsn: str, observer: Conn) -> None:
    committed: list[str] = []
    with agent_runs.create_pool(dsn, min_size=2, max_size=2) as pool:

        def work(n: int) -> None:
            for i in range(ROUNDS):
                with pool.connection() as pooled:
                    _lifecycle(AgentRunRepository(pooled), n, i, committed)

        errors = _run_threads(THREADS, work)
    assert not errors, errors[:3]
    assert set(_statuses(observer, committed).values()) == {"completed"}
    assert len(committed) == THREADS * ROUNDS


def test_a_callers_transaction_on_its_own_thread(dsn: str, conn: Conn, observer: Conn) -> None:
    """One thread runs calls inside its own transaction (savepoints released, nothing visible
    until it commits) while seven threads share another connection's repository."""
    shared = AgentRunRepository(conn)
    committed: list[str] = []
    inside: list[str] = []
    seen_before_commit: list[dict[str, str]] = []

    def work(n: int) -> None:
        if n:
            for i in range(ROUNDS):
                _lifecycle(shared, n, i, committed)
            return
        with agent_runs.connect(dsn) as own:
            repo = AgentRunRepository(own)
            with own.transaction():
                for i in range(ROUNDS):
                    _lifecycle(repo, n, i, inside)
                    assert own.info.transaction_status == pq.TransactionStatus.INTRANS
                with psycopg.connect(dsn, autocommit=True) as other:
                    seen_before_commit.append(_statuses(other, inside))
            assert own.info.transaction_status == pq.TransactionStatus.IDLE

    errors = _run_threads(THREADS, work)
    assert not errors, errors[:3]
    assert seen_before_commit == [{}]
    assert set(_statuses(observer, inside).values()) == {"completed"}
    assert set(_statuses(observer, committed).values()) == {"completed"}
    assert len(committed) == (THREADS - 1) * ROUNDS
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE


def test_reads_and_batches_interleave_with_transitions(conn: Conn, observer: Conn) -> None:
    """Multi-statement calls (reconcile) and batched renewals hold the connection whole."""
    repo = AgentRunRepository(conn)
    committed: list[str] = []

    def work(n: int) -> None:
        for i in range(ROUNDS):
            if n % 2:
                repo.reconcile_expired_leases()
                key = f"{n}-{i}-{uuid.uuid4().hex[:8]}"
                run = repo.create_run(
                    thread_id=f"t-{key}", agent_slug="a", uid="u", request_id=f"r-{key}"
                )
                claim = repo.mark_running(run.id, worker_id="w:1", lease_seconds=LEASE)
                assert claim.run is not None
                renewed = repo.renew_leases({run.id: "w:1"}, lease_seconds=LEASE)
                assert renewed == {run.id: RunStatus.RUNNING}
                repo.set_terminal_status(run.id, status="completed", worker_id="w:1")
                committed.append(run.id)
            else:
                _lifecycle(repo, n, i, committed)

    errors = _run_threads(THREADS, work)
    assert not errors, errors[:3]
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE
    assert set(_statuses(observer, committed).values()) == {"completed"}


def test_repository_transaction_keeps_other_threads_out_until_it_ends(
    conn: Conn, observer: Conn
) -> None:
    """repo.transaction() holds the connection's turn: another thread's call waits for it to
    end, then commits on its own (it does not become a savepoint of someone else's work)."""
    repo = AgentRunRepository(conn)
    order: list[str] = []
    inside = threading.Event()

    def other() -> None:
        inside.wait()
        repo.create_run(thread_id="t-b", agent_slug="a", uid="u", request_id="r-b")
        order.append("other call returned")

    thread = threading.Thread(target=other)
    thread.start()
    with repo.transaction():
        repo.create_run(thread_id="t-a", agent_slug="a", uid="u", request_id="r-a")
        inside.set()
        thread.join(timeout=0.5)  # the other call cannot finish while we hold the turn
        order.append("transaction ends")
    thread.join(timeout=10)
    assert order == ["transaction ends", "other call returned"]
    rows = observer.execute("SELECT request_id FROM agent_runs ORDER BY request_id").fetchall()
    assert rows == [("r-a",), ("r-b",)]
    assert conn.info.transaction_status == pq.TransactionStatus.IDLE
