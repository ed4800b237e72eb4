"""Races between real threads, each with its own connection, on real PostgreSQL row locks."""

from __future__ import annotations

import secrets
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from typing import Any, TypeVar

import psycopg

import agent_runs
from agent_runs import AgentRunRepository, RunStatus, ThreadBusy
from tests.helpers import at, new_run, read_state, row_counts, wait_for_lock_waiters

Conn = psycopg.Connection[Any]
T = TypeVar("T")

LEASE = 30.0
TIMEOUT = 30.0


def start_racers(
    dsn: str, count: int, body: Callable[[AgentRunRepository, int], T]
) -> tuple[ThreadPoolExecutor, list[Future[T]]]:
    """Start `count` threads, each with its own connection, released together by a barrier."""
    barrier = threading.Barrier(count)

    def racer(index: int) -> T:
        with agent_runs.connect(dsn) as conn:
            repo = AgentRunRepository(conn)
            barrier.wait(timeout=TIMEOUT)
            return body(repo, index)

    pool = ThreadPoolExecutor(max_workers=count, thread_name_prefix="racer")
    return pool, [pool.submit(racer, i) for i in range(count)]


def race(dsn: str, count: int, body: Callable[[AgentRunRepository, int], T]) -> list[T]:
    pool, futures = start_racers(dsn, count, body)
    with pool:
        return [future.result(timeout=TIMEOUT) for future in futures]


def test_racing_mark_running_on_one_run_yields_exactly_one_owner_and_one_attempt(
    dsn: str, repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    """Every racer is queued on the row lock before it is released: a real, maximal race."""
    racers = 8
    run = new_run(repo)
    with observer.transaction():
        observer.execute("SELECT 1 FROM agent_runs WHERE id = %s FOR UPDATE", (run.id,))
        pool, futures = start_racers(
            dsn,
            racers,
            lambda r, i: r.mark_running(run.id, worker_id=f"w-{i}", lease_seconds=LEASE, now=t0),
        )
        wait_for_lock_waiters(observer, racers)
    with pool:
        claims = [future.result(timeout=TIMEOUT) for future in futures]
    winners = [i for i, claim in enumerate(claims) if claim.acquired]
    assert len(winners) == 1
    stored = read_state(observer, run.id)
    assert stored.run is not None
    assert stored.run["status"] == "running" and stored.run["worker_id"] == f"w-{winners[0]}"
    assert [(a["attempt_no"], a["worker_id"]) for a in stored.attempts] == [(1, f"w-{winners[0]}")]
    for claim in claims:
        assert claim.run is not None and claim.run.worker_id == f"w-{winners[0]}"


def test_racing_mark_running_without_a_gate_also_yields_one_owner(
    dsn: str, repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    runs = [new_run(repo) for _ in range(10)]

    def body(r: AgentRunRepository, i: int) -> list[bool]:
        return [
            r.mark_running(run.id, worker_id=f"w-{i}", lease_seconds=LEASE, now=t0).acquired
            for run in runs
        ]

    results = race(dsn, 6, body)
    for index, run in enumerate(runs):
        assert sum(result[index] for result in results) == 1
        stored = read_state(observer, run.id)
        assert len(stored.attempts) == 1
        assert stored.attempts[0]["worker_id"] == stored.run["worker_id"]  # type: ignore[index]


def test_racing_claim_next_never_hands_one_run_to_two_workers(
    dsn: str, repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run_count, workers = 40, 6
    created = {new_run(repo).id for _ in range(run_count)}

    def drain(r: AgentRunRepository, i: int) -> list[str]:
        mine = []
        while (run := r.claim_next(worker_id=f"w-{i}", lease_seconds=LEASE, now=t0)) is not None:
            assert run.worker_id == f"w-{i}"
            mine.append(run.id)
        return mine

    claimed = race(dsn, workers, drain)
    every = Counter(run_id for mine in claimed for run_id in mine)
    assert set(every) == created
    assert max(every.values()) == 1
    for worker, mine in enumerate(claimed):
        for run_id in mine:
            stored = read_state(observer, run_id)
            assert stored.run is not None
            assert stored.run["status"] == "running" and stored.run["worker_id"] == f"w-{worker}"
            assert [(a["attempt_no"], a["worker_id"]) for a in stored.attempts] == [
                (1, f"w-{worker}")
            ]
    assert row_counts(observer) == (run_count, run_count)


def test_racing_claims_after_retry_releases_number_attempts_without_gaps(
    dsn: str, repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    """Claim, release, claim again from many threads: attempt numbers stay 1..n, one open."""
    runs = {new_run(repo).id for _ in range(5)}
    rounds = 6

    def churn(r: AgentRunRepository, i: int) -> int:
        claims = 0
        for step in range(rounds):
            now = at(t0, step)
            run = r.claim_next(worker_id=f"w-{i}-{step}", lease_seconds=LEASE, now=now)
            if run is not None:
                claims += 1
                assert r.release_lease_for_retry(run.id, worker_id=f"w-{i}-{step}", now=now)
        return claims

    total = sum(race(dsn, 4, churn))
    attempts = 0
    for run_id in runs:
        stored = read_state(observer, run_id)
        numbers = [a["attempt_no"] for a in stored.attempts]
        assert numbers == list(range(1, len(numbers) + 1))
        assert all(a["outcome"] == "retry_released" for a in stored.attempts)
        attempts += len(numbers)
    assert attempts == total


def test_two_concurrent_reconcilers_fail_each_expired_run_exactly_once(
    dsn: str, repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    expired = set()
    for i in range(60):
        run = new_run(repo)
        repo.mark_running(run.id, worker_id=f"w-{i}", lease_seconds=LEASE, now=t0)
        expired.add(run.id)
    live = new_run(repo)
    repo.mark_running(live.id, worker_id="live", lease_seconds=LEASE, now=at(t0, 100))
    now = at(t0, 110)

    def reconcile(r: AgentRunRepository, i: int) -> list[str]:
        converged: list[str] = []
        while batch := r.reconcile_expired_leases(now=now, limit=7):
            assert all(run.status == RunStatus.FAILED for run in batch)
            converged.extend(run.id for run in batch)
        return converged

    first, second = race(dsn, 2, reconcile)
    assert not set(first) & set(second)
    assert Counter(first + second) == Counter(expired)
    for run_id in expired:
        stored = read_state(observer, run_id)
        assert stored.run is not None and stored.run["status"] == "failed"
        [attempt] = stored.attempts
        assert attempt["outcome"] == "lease_expired" and attempt["finished_at"] == now
    live_state = read_state(observer, live.id)
    assert live_state.run is not None and live_state.run["status"] == "running"


def test_a_reconciler_skips_a_run_locked_by_its_owner_mid_transition(
    conn: Conn, repo: AgentRunRepository, observer: Conn, dsn: str, t0: datetime
) -> None:
    """The owner finishing at the last moment is never waited for nor overwritten."""
    run = new_run(repo)
    other = new_run(repo)
    repo.mark_running(run.id, worker_id="owner", lease_seconds=LEASE, now=t0)
    repo.mark_running(other.id, worker_id="other", lease_seconds=LEASE, now=t0)
    with conn.transaction():
        assert repo.set_terminal_status(
            run.id, status="completed", worker_id="owner", now=at(t0, LEASE - 1)
        ).changed
        with agent_runs.connect(dsn) as reconciler_conn:
            reconciler_conn.execute("SET lock_timeout = '5s'")
            reconciler = AgentRunRepository(reconciler_conn)
            converged = reconciler.reconcile_expired_leases(now=at(t0, LEASE + 10))
        assert [r.id for r in converged] == [other.id]
    stored = read_state(observer, run.id)
    assert stored.run is not None and stored.run["status"] == "completed"
    assert stored.attempts[0]["outcome"] == "completed"
    assert repo.reconcile_expired_leases(now=at(t0, LEASE + 20)) == []


def test_a_reconciler_converges_a_run_once_another_transaction_releases_it(
    dsn: str, repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = new_run(repo)
    repo.mark_running(run.id, worker_id="owner", lease_seconds=LEASE, now=t0)
    with observer.transaction():
        observer.execute("SELECT 1 FROM agent_runs WHERE id = %s FOR UPDATE", (run.id,))
        with agent_runs.connect(dsn) as other_conn:
            other_conn.execute("SET lock_timeout = '5s'")
            skipped = AgentRunRepository(other_conn).reconcile_expired_leases(now=at(t0, LEASE + 1))
        assert skipped == []
    [converged] = repo.reconcile_expired_leases(now=at(t0, LEASE + 1))
    assert converged.id == run.id


def test_a_durable_cancel_committed_first_wins_over_a_waiting_completion(
    dsn: str, conn: Conn, repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    """The completion waits on the row lock, then re-checks the status it finds: refused."""
    run = new_run(repo)
    repo.mark_running(run.id, worker_id="owner", lease_seconds=LEASE, now=t0)
    with conn.transaction():
        requested = repo.request_cancel(run.id, now=at(t0, 1))
        assert requested is not None and requested.status == RunStatus.CANCEL_REQUESTED
        pool, [completion] = start_racers(
            dsn,
            1,
            lambda r, i: r.set_terminal_status(
                run.id, status="completed", worker_id="owner", now=at(t0, 2)
            ),
        )
        wait_for_lock_waiters(observer, 1)
    with pool:
        late = completion.result(timeout=TIMEOUT)
    assert late.changed is False
    assert late.run is not None and late.run.status == RunStatus.CANCEL_REQUESTED
    stored = read_state(observer, run.id)
    assert stored.run is not None and stored.run["status"] == "cancel_requested"
    assert stored.attempts[0]["finished_at"] is None
    assert repo.set_terminal_status(run.id, status="cancelled", worker_id="owner", now=at(t0, 3))[1]
    assert read_state(observer, run.id).attempts[0]["outcome"] == "cancelled"


def test_a_completion_committed_first_leaves_a_waiting_cancel_nothing_to_do(
    dsn: str, conn: Conn, repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = new_run(repo)
    repo.mark_running(run.id, worker_id="owner", lease_seconds=LEASE, now=t0)
    with conn.transaction():
        assert repo.set_terminal_status(
            run.id, status="completed", worker_id="owner", now=at(t0, 1)
        ).changed
        pool, [cancel] = start_racers(dsn, 1, lambda r, i: r.request_cancel(run.id, now=at(t0, 2)))
        wait_for_lock_waiters(observer, 1)
    with pool:
        after = cancel.result(timeout=TIMEOUT)
    assert after is not None and after.status == RunStatus.COMPLETED
    stored = read_state(observer, run.id)
    assert stored.run is not None and stored.run["status"] == "completed"
    assert stored.attempts[0]["outcome"] == "completed"


def test_a_renewal_waiting_behind_the_reconciler_is_refused(
    dsn: str, conn: Conn, repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = new_run(repo)
    repo.mark_running(run.id, worker_id="owner", lease_seconds=LEASE, now=t0)
    with conn.transaction():
        [converged] = repo.reconcile_expired_leases(now=at(t0, LEASE + 1))
        assert converged.id == run.id
        pool, [renewal] = start_racers(
            dsn,
            1,
            lambda r, i: r.renew_lease(
                run.id, worker_id="owner", lease_seconds=LEASE, now=at(t0, LEASE - 1)
            ),
        )
        wait_for_lock_waiters(observer, 1)
    with pool:
        assert renewal.result(timeout=TIMEOUT) is False
    stored = read_state(observer, run.id)
    assert stored.run is not None and stored.run["status"] == "failed"
    assert stored.run["lease_expires_at"] is None
    assert stored.attempts[0]["outcome"] == "lease_expired"


def test_concurrent_creates_with_one_request_id_make_one_run(dsn: str, observer: Conn) -> None:
    """A retried request racing its original gets the same run: never ThreadBusy, one row.

    Several rounds, because the losing interleaving (both inserts past the request_id check
    before either commits) needs the racers to meet at the right instant. A large,
    incompressible payload widens that window: it is TOASTed between the two checks.
    """
    racers, rounds = 6, 10
    barrier = threading.Barrier(racers)
    blob = secrets.token_urlsafe(300_000)

    def create(r: AgentRunRepository, i: int) -> list[str]:
        ids = []
        for round_no in range(rounds):
            barrier.wait(timeout=TIMEOUT)
            try:
                run = r.create_run(
                    thread_id=f"t-{round_no}",
                    agent_slug="a",
                    uid="u",
                    request_id=f"same-request-{round_no}",
                    input_payload={"from": i, "blob": blob},
                )
                ids.append(run.id)
            except ThreadBusy as exc:
                ids.append(f"ThreadBusy: {exc}")
        return ids

    results = race(dsn, racers, create)
    for round_no in range(rounds):
        outcomes = {result[round_no] for result in results}
        assert len(outcomes) == 1, f"round {round_no}: {sorted(outcomes)}"
    assert row_counts(observer) == (rounds, 0)


def test_concurrent_creates_on_one_thread_make_one_run_and_thread_busy_for_the_rest(
    dsn: str, observer: Conn
) -> None:
    def create(r: AgentRunRepository, i: int) -> str:
        try:
            return r.create_run(thread_id="t", agent_slug="a", uid="u", request_id=f"r-{i}").id
        except ThreadBusy:
            return "busy"

    outcomes = race(dsn, 8, create)
    created = [o for o in outcomes if o != "busy"]
    assert len(created) == 1
    assert row_counts(observer) == (1, 0)
    row = observer.execute("SELECT id FROM agent_runs").fetchone()
    assert row is not None and row[0] == created[0]


def test_racing_claim_next_and_mark_running_on_one_run_yield_one_owner(
    dsn: str, repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = new_run(repo)

    def take(r: AgentRunRepository, i: int) -> bool:
        if i % 2:
            return r.mark_running(run.id, worker_id=f"w-{i}", lease_seconds=LEASE, now=t0)[1]
        return r.claim_next(worker_id=f"w-{i}", lease_seconds=LEASE, now=t0) is not None

    assert sum(race(dsn, 4, take)) == 1
    stored = read_state(observer, run.id)
    assert len(stored.attempts) == 1
    assert stored.attempts[0]["worker_id"] == stored.run["worker_id"]  # type: ignore[index]
