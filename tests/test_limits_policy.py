"""Limits per key beside the recovery policy: the policy's transitions (retry_or_fail,
requeue_run, the reconciler's retry) are counted against the key, free its slot and wake a
worker; a parked run comes back in claim order and never takes a slot before it is available."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from agent_runs import AgentRunRepository, RunStatus
from tests.helpers import new_run
from tests.test_notify import received

Conn = psycopg.Connection[Any]
LEASE = 60.0


@pytest.fixture
def claimable(dsn: str) -> Iterator[Conn]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("LISTEN agent_runs_claimable")
        conn.execute("LISTEN agent_runs_finished")  # the sentinel's channel
        yield conn


def _woken(notes: list[tuple[str, str]]) -> list[str]:
    return [payload for channel, payload in notes if channel == "agent_runs_claimable"]


def _running(observer: Conn, key: str) -> int:
    row = observer.execute(
        "SELECT running FROM agent_run_limits WHERE concurrency_key = %s", (key,)
    ).fetchone()
    assert row is not None
    return int(row[0])


def _parked(observer: Conn, run_id: str) -> bool:
    row = observer.execute("SELECT key_waiting FROM agent_runs WHERE id = %s", (run_id,)).fetchone()
    assert row is not None
    return bool(row[0])


def test_retry_or_fail_frees_the_slot_wakes_a_worker_and_the_retry_waits_its_turn(
    repo: AgentRunRepository, observer: Conn, claimable: Conn
) -> None:
    repo.set_limit("provider:p", 1)
    first = new_run(repo, concurrency_key="provider:p", agent_slug="summarize")
    second = new_run(repo, concurrency_key="provider:p", agent_slug="translate")
    assert repo.claim_next(worker_id="w-1", lease_seconds=LEASE).id == first.id  # type: ignore[union-attr]
    assert _parked(observer, second.id) and _running(observer, "provider:p") == 1
    received(claimable, observer)
    retried = repo.retry_or_fail(
        first.id, worker_id="w-1", error_type="rate_limited", retry_after_seconds=600
    )
    assert retried.changed and retried.run is not None
    assert retried.run.status == RunStatus.PENDING
    assert _running(observer, "provider:p") == 0
    assert "translate" in _woken(received(claimable, observer))
    assert not _parked(observer, second.id)
    # The retried run is not available for ten minutes: the slot goes to the next one.
    assert repo.claim_next(worker_id="w-2", lease_seconds=LEASE).id == second.id  # type: ignore[union-attr]
    assert _running(observer, "provider:p") == 1 and _parked(observer, first.id)
    failed = repo.retry_or_fail(second.id, worker_id="w-2", error_type="bad", now=None)
    assert failed.changed and _running(observer, "provider:p") == 0
    later = datetime.now(UTC) + timedelta(minutes=11)
    claimed = repo.claim_next(worker_id="w-3", lease_seconds=LEASE, now=later)
    assert claimed is not None and claimed.id in {first.id, second.id}
    assert _running(observer, "provider:p") == 1


def test_a_freed_slot_brings_back_an_available_run_before_one_scheduled_for_later(
    repo: AgentRunRepository, observer: Conn
) -> None:
    repo.set_limit("user:u", 1)
    blocker = new_run(repo, concurrency_key="user:u")
    assert repo.claim_next(worker_id="w-1", lease_seconds=LEASE).id == blocker.id  # type: ignore[union-attr]
    in_an_hour = datetime.now(UTC) + timedelta(hours=1)
    scheduled = new_run(repo, concurrency_key="user:u", priority=0, available_at=in_an_hour)
    available = new_run(repo, concurrency_key="user:u", priority=5)
    assert _parked(observer, scheduled.id) and _parked(observer, available.id)
    assert scheduled.id in {r.id for r in repo.list_scheduled_runs()}  # parked, still listed
    assert repo.set_terminal_status(blocker.id, status="completed", worker_id="w-1").changed
    # First in claim order is the priority-0 run, but it is not available: the slot goes on.
    assert not _parked(observer, available.id) and _parked(observer, scheduled.id)
    claimed = repo.claim_next(worker_id="w-2", lease_seconds=LEASE)
    assert claimed is not None and claimed.id == available.id
    assert repo.set_terminal_status(available.id, status="completed", worker_id="w-2").changed
    # A slot and only a run scheduled for later: it comes back, to be claimed once available.
    assert not _parked(observer, scheduled.id)
    assert repo.claim_next(worker_id="w-3", lease_seconds=LEASE) is None
    later = in_an_hour + timedelta(seconds=1)
    claimed = repo.claim_next(worker_id="w-3", lease_seconds=LEASE, now=later)
    assert claimed is not None and claimed.id == scheduled.id


def test_a_requeued_run_is_counted_and_a_parked_one_has_its_key_checked_again(
    repo: AgentRunRepository, observer: Conn
) -> None:
    repo.set_limit("user:q", 1)
    blocker = new_run(repo, concurrency_key="user:q")
    assert repo.claim_next(worker_id="w-1", lease_seconds=LEASE).id == blocker.id  # type: ignore[union-attr]
    waiting = new_run(repo, concurrency_key="user:q")
    assert _parked(observer, waiting.id)
    cancelled = repo.request_cancel(waiting.id)
    assert cancelled is not None and cancelled.status == RunStatus.CANCELLED
    assert repo.set_terminal_status(
        blocker.id, status="failed", worker_id="w-1", error_type="boom"
    ).changed
    assert _running(observer, "user:q") == 0
    # Requeued while still marked parked: its key has a slot, so it comes back to the index.
    assert repo.requeue_run(waiting.id, reason="again").changed
    assert not _parked(observer, waiting.id)
    assert repo.claim_next(worker_id="w-2", lease_seconds=LEASE).id == waiting.id  # type: ignore[union-attr]
    assert _running(observer, "user:q") == 1
    # The failed blocker requeued while the key is full: never claimed past the limit.
    assert repo.requeue_run(blocker.id).changed
    assert repo.claim_next(worker_id="w-3", lease_seconds=LEASE) is None
    assert repo.set_terminal_status(waiting.id, status="completed", worker_id="w-2").changed
    assert repo.claim_next(worker_id="w-3", lease_seconds=LEASE).id == blocker.id  # type: ignore[union-attr]
    assert _running(observer, "user:q") == 1


def test_the_reconciler_retrying_a_lost_run_frees_its_slot_and_wakes_a_worker(
    repo: AgentRunRepository, observer: Conn, claimable: Conn
) -> None:
    repo.set_policy("crashy", max_lost_leases=1, backoff_seconds=60, backoff_jitter=0)
    repo.set_limit("provider:r", 1)
    lost = new_run(repo, concurrency_key="provider:r", agent_slug="crashy")
    waiting = new_run(repo, concurrency_key="provider:r", agent_slug="patient")
    assert repo.claim_next(worker_id="w-1", lease_seconds=1.0).id == lost.id  # type: ignore[union-attr]
    assert _parked(observer, waiting.id)
    received(claimable, observer)
    later = datetime.now(UTC) + timedelta(seconds=30)
    converged = repo.reconcile_expired_leases(now=later)
    assert [(r.id, r.status) for r in converged] == [(lost.id, RunStatus.PENDING)]
    assert _running(observer, "provider:r") == 0
    woken = _woken(received(claimable, observer))
    assert "patient" in woken, woken  # the full key's freed slot (the trigger)
    assert "crashy" in woken, woken  # the retried run itself (the reconciler)
    assert not _parked(observer, waiting.id)
    claimed = repo.claim_next(worker_id="w-2", lease_seconds=LEASE, now=later)
    assert claimed is not None and claimed.id == waiting.id  # the retry is backing off
    assert _running(observer, "provider:r") == 1
    assert repo.claim_next(worker_id="w-3", lease_seconds=LEASE, now=later) is None
