"""The transition rules, rule by rule, read back from the database."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import agent_runs
from agent_runs import (
    AgentRun,
    AgentRunRepository,
    AttemptOutcome,
    Claim,
    NotLeaseOwner,
    RunStatus,
    ThreadBusy,
    Transition,
    manifest_fingerprint,
)
from tests.fix_factories import AttemptFactory, RunFactory
from tests.helpers import OTHER, OWNER, State, at, new_run, read_state, row_counts

Conn = psycopg.Connection[Any]

LEASE = 30.0
TERMINAL = ("completed", "failed", "cancelled", "interrupted")
LOST = "worker_lease_expired"


def running_run(repo: AgentRunRepository, t0: datetime, worker_id: str = OWNER) -> AgentRun:
    """A run claimed by `worker_id` at t0 with a LEASE-second lease (attempt 1 open)."""
    run = new_run(repo)
    claim = repo.mark_running(run.id, worker_id=worker_id, lease_seconds=LEASE, now=t0)
    assert claim.acquired and claim.run is not None
    return claim.run


def cancel_requested_run(repo: AgentRunRepository, t0: datetime) -> AgentRun:
    """A run owned by OWNER (live until t0 + LEASE) whose cancel was requested at t0 + 1."""
    run = running_run(repo, t0)
    cancelled = repo.request_cancel(run.id, now=at(t0, 1))
    assert cancelled is not None and cancelled.status == RunStatus.CANCEL_REQUESTED
    return cancelled


def released_run(repo: AgentRunRepository, t0: datetime) -> AgentRun:
    """A run that started (attempt 1 by OWNER) and was released for retry at t0 + 5: pending."""
    run = running_run(repo, t0)
    assert repo.release_lease_for_retry(run.id, worker_id=OWNER, now=at(t0, 5))
    released = repo.get_run(run.id)
    assert released is not None and released.status == RunStatus.PENDING
    return released


def assert_unchanged(observer: Conn, before: State) -> None:
    assert before.run is not None
    assert read_state(observer, before.run["id"]) == before


# --- create_run and the readers --------------------------------------------------------------


def test_create_run_stores_a_pending_run_with_no_lease_and_no_attempt(
    repo: AgentRunRepository, observer: Conn
) -> None:
    payload = {"prompt": "hello", "nested": {"list": [1, 2.5, None, True]}, "ünï": "☃"}
    run = repo.create_run(
        thread_id="thread-1",
        agent_slug="planner",
        uid="user-1",
        request_id="req-1",
        input_payload=payload,
    )
    stored = read_state(observer, run.id)
    assert stored.run is not None and stored.attempts == []
    assert stored.run["status"] == "pending"
    assert stored.run["run_type"] == "chat"
    assert stored.run["input_payload"] == payload
    assert (stored.run["thread_id"], stored.run["agent_slug"], stored.run["uid"]) == (
        "thread-1",
        "planner",
        "user-1",
    )
    assert stored.run["request_id"] == "req-1"
    for column in ("worker_id", "heartbeat_at", "lease_expires_at", "started_at", "finished_at"):
        assert stored.run[column] is None, column
    assert str(uuid.UUID(run.id)) == run.id  # a uuid string by default
    assert run.status == RunStatus.PENDING
    assert str(run.status) == "pending" and run.status == RunStatus("pending")
    assert run.input_payload == payload
    assert run.created_at == stored.run["created_at"]


def test_create_run_uses_the_given_run_id_type_and_parent(
    repo: AgentRunRepository, observer: Conn
) -> None:
    parent = new_run(repo)
    child = new_run(repo, run_id="child-run", run_type="subagent", created_by_run_id=parent.id)
    stored = read_state(observer, "child-run").run
    assert stored is not None and child.id == "child-run"
    assert stored["run_type"] == "subagent" and child.run_type == "subagent"
    assert stored["created_by_run_id"] == parent.id == child.created_by_run_id


def test_the_same_request_id_returns_the_existing_run_whatever_its_status(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    first = new_run(repo, request_id="once", input_payload={"n": 1})
    again = new_run(repo, request_id="once", input_payload={"n": 2})
    assert again.id == first.id and again.input_payload == {"n": 1}
    assert repo.mark_running(first.id, worker_id=OWNER, lease_seconds=LEASE, now=t0).acquired
    assert repo.set_terminal_status(first.id, status="completed", worker_id=OWNER, now=t0).changed
    before = read_state(observer, first.id)
    counts = row_counts(observer)
    replay = new_run(repo, request_id="once", thread_id="another-thread", uid="someone-else")
    assert replay.id == first.id and replay.status == RunStatus.COMPLETED
    assert row_counts(observer) == counts
    assert_unchanged(observer, before)


def test_the_same_request_id_on_a_busy_thread_is_not_thread_busy(
    repo: AgentRunRepository, observer: Conn
) -> None:
    """Idempotency is checked first: a retried request gets its own run, not ThreadBusy."""
    first = repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r")
    again = repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r")
    assert again.id == first.id
    assert row_counts(observer) == (1, 0)


@pytest.mark.parametrize("busy_status", ["pending", "running", "cancel_requested"])
def test_a_second_active_run_on_a_thread_raises_thread_busy_and_writes_nothing(
    repo: AgentRunRepository, observer: Conn, t0: datetime, busy_status: str
) -> None:
    first = repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r1")
    if busy_status != "pending":
        repo.mark_running(first.id, worker_id=OWNER, lease_seconds=LEASE, now=t0)
    if busy_status == "cancel_requested":
        repo.request_cancel(first.id, now=t0)
    assert read_state(observer, first.id).run["status"] == busy_status  # type: ignore[index]
    counts = row_counts(observer)
    with pytest.raises(ThreadBusy):
        repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r2")
    assert row_counts(observer) == counts
    assert repo.get_run(first.id) is not None


def test_thread_busy_is_per_uid_agent_and_thread(repo: AgentRunRepository, observer: Conn) -> None:
    repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r1")
    repo.create_run(thread_id="t2", agent_slug="a", uid="u", request_id="r2")
    repo.create_run(thread_id="t", agent_slug="b", uid="u", request_id="r3")
    repo.create_run(thread_id="t", agent_slug="a", uid="v", request_id="r4")
    assert row_counts(observer) == (4, 0)


def test_a_thread_accepts_a_new_run_once_its_run_is_terminal(
    repo: AgentRunRepository, observer: Conn
) -> None:
    first = repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r1")
    assert repo.set_terminal_status(first.id, status="cancelled").changed
    second = repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r2")
    assert second.id != first.id and second.status == RunStatus.PENDING
    assert row_counts(observer) == (2, 0)


def test_readers_of_a_missing_run_return_nothing(repo: AgentRunRepository) -> None:
    assert repo.get_run("no-such-run") is None
    assert repo.list_run_attempts("no-such-run") == []
    assert repo.get_open_attempt("no-such-run") is None


def test_values_are_frozen_dataclasses_with_utc_timestamps(
    repo: AgentRunRepository, t0: datetime
) -> None:
    run = running_run(repo, t0)
    attempt = repo.get_open_attempt(run.id)
    assert attempt is not None
    with pytest.raises(AttributeError):
        run.status = RunStatus.FAILED  # type: ignore[misc]
    for value in (run.created_at, run.updated_at, run.started_at, run.lease_expires_at):
        assert value is not None and value.utcoffset() == timedelta(0)
    for value in (attempt.started_at, attempt.heartbeat_at, attempt.created_at):
        assert value is not None and value.utcoffset() == timedelta(0)
    assert isinstance(run.status, RunStatus)


def test_timestamps_are_utc_even_when_the_session_time_zone_is_not(
    dsn: str, observer: Conn, t0: datetime
) -> None:
    dbname = observer.execute("SELECT current_database()").fetchone()
    assert dbname is not None
    observer.execute(
        psycopg.sql.SQL("ALTER DATABASE {} SET timezone = 'Asia/Kolkata'").format(
            psycopg.sql.Identifier(dbname[0])
        )
    )
    with agent_runs.connect(dsn) as conn:
        repo = AgentRunRepository(conn)
        run = running_run(repo, t0)
        attempts = repo.list_run_attempts(run.id)
    assert run.started_at == t0
    assert run.created_at.tzinfo is not None and run.created_at.utcoffset() == timedelta(0)
    assert run.started_at is not None and run.started_at.utcoffset() == timedelta(0)
    assert attempts[0].started_at.utcoffset() == timedelta(0)


# --- mark_running ------------------------------------------------------------------------------


def test_mark_running_a_missing_run_returns_none_and_writes_nothing(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    assert repo.mark_running("no-such-run", worker_id=OWNER, lease_seconds=LEASE, now=t0) == (
        None,
        False,
    )
    assert row_counts(observer) == (0, 0)


def test_an_initial_claim_makes_the_run_running_and_opens_attempt_one(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = new_run(repo)
    claim = repo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0)
    assert isinstance(claim, Claim) and claim.acquired
    stored = read_state(observer, run.id)
    assert stored.run is not None
    assert stored.run["status"] == "running"
    assert stored.run["worker_id"] == OWNER
    assert stored.run["heartbeat_at"] == t0
    assert stored.run["lease_expires_at"] == at(t0, LEASE)
    assert stored.run["started_at"] == t0
    assert stored.run["finished_at"] is None
    [attempt] = stored.attempts
    assert attempt["attempt_no"] == 1
    assert attempt["worker_id"] == OWNER
    assert attempt["started_at"] == t0
    assert attempt["heartbeat_at"] == t0
    assert attempt["lease_expires_at"] == at(t0, LEASE)
    assert attempt["finished_at"] is None and attempt["outcome"] is None
    assert claim.run is not None and claim.run.status == RunStatus.RUNNING
    assert claim.run.lease_expires_at == at(t0, LEASE)
    open_attempt = repo.get_open_attempt(run.id)
    assert open_attempt is not None and open_attempt.id == attempt["id"] and open_attempt.is_open


def test_the_same_live_owner_claiming_again_refreshes_its_lease_without_a_new_attempt(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = running_run(repo, t0)
    first = read_state(observer, run.id).attempts[0]
    claim = repo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE, now=at(t0, 10))
    assert claim.acquired
    stored = read_state(observer, run.id)
    assert stored.run is not None
    assert stored.run["heartbeat_at"] == at(t0, 10)
    assert stored.run["lease_expires_at"] == at(t0, 10 + LEASE)
    assert stored.run["started_at"] == t0
    [attempt] = stored.attempts
    assert attempt["id"] == first["id"] and attempt["attempt_no"] == 1
    assert attempt["heartbeat_at"] == at(t0, 10)
    assert attempt["lease_expires_at"] == at(t0, 10 + LEASE)
    assert attempt["started_at"] == t0 and attempt["finished_at"] is None


def test_the_same_live_owner_of_a_cancel_requested_run_may_claim_again(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = cancel_requested_run(repo, t0)
    claim = repo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE, now=at(t0, 2))
    assert claim.acquired and claim.run is not None
    assert claim.run.status == RunStatus.CANCEL_REQUESTED
    stored = read_state(observer, run.id)
    assert stored.run is not None and stored.run["lease_expires_at"] == at(t0, 2 + LEASE)
    assert len(stored.attempts) == 1


@pytest.mark.parametrize(
    ("worker_id", "seconds"),
    [(OTHER, 1), (OWNER, LEASE), (OWNER, LEASE + 1), (OTHER, LEASE + 1)],
    ids=["other-worker-live-lease", "owner-at-expiry", "owner-after-expiry", "other-after-expiry"],
)
def test_mark_running_refuses_a_running_run_it_may_not_take(
    repo: AgentRunRepository, observer: Conn, t0: datetime, worker_id: str, seconds: float
) -> None:
    """Neither an initial claim nor the same live owner: (run, False), nothing written."""
    run = running_run(repo, t0)
    before = read_state(observer, run.id)
    claim = repo.mark_running(run.id, worker_id=worker_id, lease_seconds=LEASE, now=at(t0, seconds))
    assert claim.acquired is False
    assert claim.run is not None and claim.run.id == run.id and claim.run.worker_id == OWNER
    assert_unchanged(observer, before)


@pytest.mark.parametrize(("worker_id", "seconds"), [(OTHER, 2), (OWNER, LEASE + 1)])
def test_mark_running_refuses_an_owned_cancel_requested_run(
    repo: AgentRunRepository, observer: Conn, t0: datetime, worker_id: str, seconds: float
) -> None:
    run = cancel_requested_run(repo, t0)
    before = read_state(observer, run.id)
    claim = repo.mark_running(run.id, worker_id=worker_id, lease_seconds=LEASE, now=at(t0, seconds))
    assert claim == (repo.get_run(run.id), False)
    assert_unchanged(observer, before)


@pytest.mark.parametrize("status", TERMINAL)
def test_mark_running_refuses_a_terminal_run(
    repo: AgentRunRepository, observer: Conn, make_run: RunFactory, t0: datetime, status: str
) -> None:
    run = make_run(status=status, started_at=t0, finished_at=at(t0, 1))
    before = read_state(observer, run.id)
    claim = repo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE, now=at(t0, 2))
    assert claim.acquired is False and claim.run is not None and claim.run.status == status
    assert_unchanged(observer, before)


def test_a_claim_after_a_retry_release_keeps_started_at_and_opens_the_next_attempt(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = released_run(repo, t0)
    attempt_one = read_state(observer, run.id).attempts[0]
    claim = repo.mark_running(run.id, worker_id=OTHER, lease_seconds=LEASE, now=at(t0, 60))
    assert claim.acquired
    stored = read_state(observer, run.id)
    assert stored.run is not None
    assert stored.run["started_at"] == t0  # coalesce(started_at, now)
    assert stored.run["status"] == "running" and stored.run["worker_id"] == OTHER
    assert stored.attempts[0] == attempt_one  # the old fact stays untouched
    assert stored.attempts[1]["attempt_no"] == 2
    assert stored.attempts[1]["worker_id"] == OTHER
    assert stored.attempts[1]["started_at"] == at(t0, 60)
    assert stored.attempts[1]["finished_at"] is None


def test_an_initial_claim_of_an_ownerless_cancel_requested_run_keeps_it_cancel_requested(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = released_run(repo, t0)
    requested = repo.request_cancel(run.id, now=at(t0, 6))
    assert requested is not None and requested.status == RunStatus.CANCEL_REQUESTED
    assert requested.worker_id is None
    claim = repo.mark_running(run.id, worker_id=OTHER, lease_seconds=LEASE, now=at(t0, 7))
    assert claim.acquired and claim.run is not None
    stored = read_state(observer, run.id)
    assert stored.run is not None
    assert stored.run["status"] == "cancel_requested"
    assert stored.run["worker_id"] == OTHER
    assert stored.run["lease_expires_at"] == at(t0, 7 + LEASE)
    assert [a["attempt_no"] for a in stored.attempts] == [1, 2]
    assert stored.attempts[1]["worker_id"] == OTHER and stored.attempts[1]["finished_at"] is None


@pytest.mark.parametrize("claim_with", ["mark_running", "claim_next"])
def test_an_initial_claim_converges_a_forged_open_attempt_to_lease_expired(
    repo: AgentRunRepository,
    observer: Conn,
    make_run: RunFactory,
    make_attempt: AttemptFactory,
    t0: datetime,
    *,
    claim_with: str,
) -> None:
    run = make_run(started_at=t0)
    done = make_attempt(
        run.id,
        attempt_no=1,
        worker_id="ghost-0",
        started_at=t0,
        finished_at=at(t0, 1),
        outcome="retry_released",
    )
    forged = make_attempt(run.id, attempt_no=2, worker_id="ghost-1", started_at=at(t0, 2))
    finished_before = read_state(observer, run.id).attempts[0]
    now = at(t0, 100)
    if claim_with == "mark_running":
        assert repo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE, now=now).acquired
    else:
        claimed = repo.claim_next(worker_id=OWNER, lease_seconds=LEASE, now=now)
        assert claimed is not None and claimed.id == run.id
    stored = read_state(observer, run.id)
    assert [a["attempt_no"] for a in stored.attempts] == [1, 2, 3]
    assert stored.attempts[0] == finished_before and stored.attempts[0]["id"] == done.id
    converged = stored.attempts[1]
    assert converged["id"] == forged.id
    assert converged["outcome"] == "lease_expired"
    assert converged["error_type"] == LOST
    assert converged["finished_at"] == now
    assert converged["worker_id"] == "ghost-1"
    opened = stored.attempts[2]
    assert opened["worker_id"] == OWNER and opened["finished_at"] is None
    assert opened["started_at"] == now


# --- claim_next --------------------------------------------------------------------------------


def test_claim_next_returns_none_when_nothing_is_claimable(
    repo: AgentRunRepository, observer: Conn, make_run: RunFactory, t0: datetime
) -> None:
    assert repo.claim_next(worker_id=OWNER, lease_seconds=LEASE, now=t0) is None
    running_run(repo, t0)  # live owner
    running_run(repo, at(t0, -100))  # expired owner: the reconciler's, not a claimer's
    cancel_requested_run(repo, t0)  # owned cancel request
    for status in TERMINAL:
        make_run(status=status, finished_at=t0)
    before = observer.execute("SELECT * FROM agent_runs ORDER BY id").fetchall()
    counts = row_counts(observer)
    assert repo.claim_next(worker_id=OTHER, lease_seconds=LEASE, now=at(t0, 5)) is None
    assert observer.execute("SELECT * FROM agent_runs ORDER BY id").fetchall() == before
    assert row_counts(observer) == counts


def test_claim_next_is_fifo_by_created_at_then_id(
    repo: AgentRunRepository, observer: Conn, make_run: RunFactory, t0: datetime
) -> None:
    created = {
        "run-c": at(t0, -30),
        "run-b": at(t0, -60),
        "run-a": at(t0, -30),  # same created_at as run-c: id breaks the tie
        "run-d": at(t0, -10),
        "run-0": at(t0, -5),
    }
    for run_id, created_at in created.items():
        make_run(id=run_id, created_at=created_at)
    order = sorted(created, key=lambda run_id: (created[run_id], run_id))
    claimed = []
    for i in range(len(created)):
        run = repo.claim_next(worker_id=f"w-{i}", lease_seconds=LEASE, now=t0)
        assert run is not None
        claimed.append(run.id)
    assert claimed == order == ["run-b", "run-a", "run-c", "run-d", "run-0"]
    assert repo.claim_next(worker_id="w-x", lease_seconds=LEASE, now=t0) is None
    rows = observer.execute("SELECT id, worker_id, status FROM agent_runs").fetchall()
    assert {(run_id, f"w-{claimed.index(run_id)}", "running") for run_id in created} == set(rows)


def test_claim_next_makes_a_pending_run_running_with_attempt_one(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = new_run(repo)
    claimed = repo.claim_next(worker_id=OWNER, lease_seconds=LEASE, now=t0)
    assert claimed is not None and claimed.id == run.id
    assert claimed.status == RunStatus.RUNNING and claimed.worker_id == OWNER
    stored = read_state(observer, run.id)
    assert stored.run is not None and stored.run["status"] == "running"
    assert stored.run["lease_expires_at"] == at(t0, LEASE) and stored.run["started_at"] == t0
    [attempt] = stored.attempts
    assert (attempt["attempt_no"], attempt["worker_id"], attempt["finished_at"]) == (1, OWNER, None)


def test_claim_next_filters_by_agent_slugs(
    repo: AgentRunRepository, observer: Conn, make_run: RunFactory, t0: datetime
) -> None:
    make_run(id="old-writer", agent_slug="writer", created_at=at(t0, -50))
    make_run(id="reader", agent_slug="reader", created_at=at(t0, -40))
    make_run(id="critic", agent_slug="critic", created_at=at(t0, -30))
    claimed = repo.claim_next(worker_id=OWNER, lease_seconds=LEASE, now=t0, agent_slugs=["critic"])
    assert claimed is not None and claimed.id == "critic"
    both = ["reader", "critic"]
    claimed = repo.claim_next(worker_id=OWNER, lease_seconds=LEASE, now=t0, agent_slugs=both)
    assert claimed is not None and claimed.id == "reader"
    assert repo.claim_next(worker_id=OWNER, lease_seconds=LEASE, now=t0, agent_slugs=both) is None
    stored = read_state(observer, "old-writer").run
    assert stored is not None and stored["status"] == "pending"
    claimed = repo.claim_next(worker_id=OWNER, lease_seconds=LEASE, now=t0, agent_slugs=None)
    assert claimed is not None and claimed.id == "old-writer"


def test_claim_next_takes_an_ownerless_cancel_requested_run_which_stays_cancel_requested(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = released_run(repo, t0)
    repo.request_cancel(run.id, now=at(t0, 6))
    claimed = repo.claim_next(worker_id=OTHER, lease_seconds=LEASE, now=at(t0, 7))
    assert claimed is not None and claimed.id == run.id
    assert claimed.status == RunStatus.CANCEL_REQUESTED and claimed.worker_id == OTHER
    stored = read_state(observer, run.id)
    assert stored.run is not None and stored.run["status"] == "cancel_requested"
    assert stored.run["worker_id"] == OTHER
    assert [a["attempt_no"] for a in stored.attempts] == [1, 2]
    # Its claimer finishes it cancelled; the attempt records the same outcome.
    done = repo.set_terminal_status(run.id, status="cancelled", worker_id=OTHER, now=at(t0, 8))
    assert done.changed
    final = read_state(observer, run.id)
    assert final.run is not None and final.run["status"] == "cancelled"
    assert final.attempts[1]["outcome"] == "cancelled"


def test_claim_next_skips_a_run_another_transaction_has_locked(
    repo: AgentRunRepository, conn: Conn, observer: Conn, make_run: RunFactory, t0: datetime
) -> None:
    make_run(id="oldest", created_at=at(t0, -20))
    make_run(id="younger", created_at=at(t0, -10))
    conn.execute("SET lock_timeout = '2s'")  # a blocking claim fails instead of hanging
    with observer.transaction():
        observer.execute("SELECT 1 FROM agent_runs WHERE id = 'oldest' FOR UPDATE")
        claimed = repo.claim_next(worker_id=OWNER, lease_seconds=LEASE, now=t0)
        assert claimed is not None and claimed.id == "younger"
    oldest = read_state(observer, "oldest")
    assert oldest.run is not None and oldest.run["status"] == "pending" and oldest.attempts == []


# --- renew_lease -------------------------------------------------------------------------------


@pytest.mark.parametrize("make", [running_run, cancel_requested_run])
def test_renew_lease_moves_the_run_and_its_open_attempt_forward(
    repo: AgentRunRepository, observer: Conn, t0: datetime, make: Any
) -> None:
    run = make(repo, t0)
    before = read_state(observer, run.id)
    assert repo.renew_lease(run.id, worker_id=OWNER, lease_seconds=45, now=at(t0, 20)) is True
    stored = read_state(observer, run.id)
    assert stored.run is not None and before.run is not None
    assert stored.run["heartbeat_at"] == at(t0, 20)
    assert stored.run["lease_expires_at"] == at(t0, 65)
    assert stored.run["status"] == before.run["status"]
    assert stored.run["worker_id"] == OWNER
    [attempt] = stored.attempts
    assert attempt["heartbeat_at"] == at(t0, 20)
    assert attempt["lease_expires_at"] == at(t0, 65)
    assert attempt["finished_at"] is None and attempt["started_at"] == t0


@pytest.mark.parametrize(
    ("worker_id", "seconds"),
    [(OTHER, 1), (OWNER, LEASE), (OWNER, LEASE + 0.001), (OWNER, 3600)],
    ids=["stale-owner", "expired-exactly-at-expiry", "just-expired", "long-expired"],
)
def test_renew_lease_is_refused_to_a_stale_or_expired_owner(
    repo: AgentRunRepository, observer: Conn, t0: datetime, worker_id: str, seconds: float
) -> None:
    run = running_run(repo, t0)
    before = read_state(observer, run.id)
    assert not repo.renew_lease(
        run.id, worker_id=worker_id, lease_seconds=LEASE, now=at(t0, seconds)
    )
    assert_unchanged(observer, before)


def test_renew_lease_is_refused_for_pending_terminal_and_missing_runs(
    repo: AgentRunRepository, observer: Conn, make_run: RunFactory, t0: datetime
) -> None:
    pending = released_run(repo, t0)
    terminal = make_run(status="completed", finished_at=t0)
    for run_id in (pending.id, terminal.id):
        before = read_state(observer, run_id)
        assert not repo.renew_lease(run_id, worker_id=OWNER, lease_seconds=LEASE, now=at(t0, 6))
        assert_unchanged(observer, before)
    assert not repo.renew_lease("no-such-run", worker_id=OWNER, lease_seconds=LEASE, now=t0)


# --- release_lease_for_retry ------------------------------------------------------------------


def test_release_for_retry_returns_the_run_to_pending_and_finishes_the_attempt(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = running_run(repo, t0)
    assert repo.release_lease_for_retry(run.id, worker_id=OWNER, now=at(t0, 5)) is True
    stored = read_state(observer, run.id)
    assert stored.run is not None
    assert stored.run["status"] == "pending"
    assert (
        stored.run["worker_id"],
        stored.run["heartbeat_at"],
        stored.run["lease_expires_at"],
    ) == (
        None,
        None,
        None,
    )
    assert stored.run["started_at"] == t0 and stored.run["finished_at"] is None
    [attempt] = stored.attempts
    assert attempt["outcome"] == "retry_released"
    assert attempt["finished_at"] == at(t0, 5)
    assert attempt["worker_id"] == OWNER
    assert repo.get_open_attempt(run.id) is None


def test_the_claim_after_a_release_is_attempt_two_and_attempt_one_stays_untouched(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = running_run(repo, t0)
    assert repo.release_lease_for_retry(run.id, worker_id=OWNER, now=at(t0, 5))
    attempt_one = read_state(observer, run.id).attempts[0]
    claimed = repo.claim_next(worker_id=OTHER, lease_seconds=LEASE, now=at(t0, 6))
    assert claimed is not None and claimed.id == run.id
    assert repo.renew_lease(run.id, worker_id=OTHER, lease_seconds=LEASE, now=at(t0, 7))
    assert repo.set_terminal_status(run.id, status="completed", worker_id=OTHER, now=at(t0, 8))[1]
    stored = read_state(observer, run.id)
    assert stored.attempts[0] == attempt_one
    assert [(a["attempt_no"], a["worker_id"], a["outcome"]) for a in stored.attempts] == [
        (1, OWNER, "retry_released"),
        (2, OTHER, "completed"),
    ]
    assert [a.attempt_no for a in repo.list_run_attempts(run.id)] == [1, 2]


@pytest.mark.parametrize(
    ("worker_id", "seconds"),
    [(OTHER, 1), (OWNER, LEASE), (OWNER, LEASE + 1)],
    ids=["stale-owner", "expired-exactly-at-expiry", "expired"],
)
def test_release_for_retry_is_refused_to_a_stale_or_expired_owner(
    repo: AgentRunRepository, observer: Conn, t0: datetime, worker_id: str, seconds: float
) -> None:
    run = running_run(repo, t0)
    before = read_state(observer, run.id)
    assert not repo.release_lease_for_retry(run.id, worker_id=worker_id, now=at(t0, seconds))
    assert_unchanged(observer, before)


def test_release_for_retry_is_refused_for_a_cancel_requested_run(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    """Only a running run can go back to the queue: a cancel request is not undone."""
    run = cancel_requested_run(repo, t0)
    before = read_state(observer, run.id)
    assert not repo.release_lease_for_retry(run.id, worker_id=OWNER, now=at(t0, 2))
    assert_unchanged(observer, before)


def test_release_for_retry_is_refused_for_pending_terminal_and_missing_runs(
    repo: AgentRunRepository, observer: Conn, make_run: RunFactory, t0: datetime
) -> None:
    pending = released_run(repo, t0)
    terminal = make_run(status="failed", finished_at=t0)
    for run_id in (pending.id, terminal.id):
        before = read_state(observer, run_id)
        assert not repo.release_lease_for_retry(run_id, worker_id=OWNER, now=at(t0, 6))
        assert_unchanged(observer, before)
    assert not repo.release_lease_for_retry("no-such-run", worker_id=OWNER, now=t0)


# --- set_terminal_status -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "error_type", "error_message"),
    [
        ("completed", None, None),
        ("failed", "tool_error", "the tool said no"),
        ("interrupted", "user_interrupt", "stopped by the user"),
    ],
)
def test_the_owner_finishes_a_running_run_and_its_attempt_with_the_same_classification(
    repo: AgentRunRepository,
    observer: Conn,
    t0: datetime,
    *,
    status: str,
    error_type: str | None,
    error_message: str | None,
) -> None:
    run = running_run(repo, t0)
    result = repo.set_terminal_status(
        run.id,
        status=status,
        worker_id=OWNER,
        error_type=error_type,
        error_message=error_message,
        now=at(t0, 10),
    )
    assert isinstance(result, Transition) and result.changed
    assert result.run is not None and result.run.status == status
    stored = read_state(observer, run.id)
    assert stored.run is not None
    assert stored.run["status"] == status
    assert stored.run["finished_at"] == at(t0, 10)
    assert (stored.run["error_type"], stored.run["error_message"]) == (error_type, error_message)
    assert (
        stored.run["worker_id"],
        stored.run["heartbeat_at"],
        stored.run["lease_expires_at"],
    ) == (
        None,
        None,
        None,
    )
    [attempt] = stored.attempts
    assert attempt["outcome"] == status
    assert attempt["finished_at"] == at(t0, 10)
    assert (attempt["error_type"], attempt["error_message"]) == (error_type, error_message)


def test_the_owner_finishes_a_cancel_requested_run_as_cancelled(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = cancel_requested_run(repo, t0)
    result = repo.set_terminal_status(run.id, status="cancelled", worker_id=OWNER, now=at(t0, 3))
    assert result.changed and result.run is not None
    assert result.run.status == RunStatus.CANCELLED
    stored = read_state(observer, run.id)
    assert stored.run is not None and stored.run["status"] == "cancelled"
    assert stored.run["finished_at"] == at(t0, 3) and stored.run["worker_id"] is None
    assert stored.attempts[0]["outcome"] == AttemptOutcome.CANCELLED


def test_a_running_run_may_not_become_cancelled_even_by_its_owner(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    """Cancel is requested first (request_cancel); a worker cannot skip that step."""
    run = running_run(repo, t0)
    before = read_state(observer, run.id)
    result = repo.set_terminal_status(run.id, status="cancelled", worker_id=OWNER, now=at(t0, 2))
    assert result.changed is False and result.run is not None
    assert result.run.status == RunStatus.RUNNING
    assert_unchanged(observer, before)


@pytest.mark.parametrize("status", ["completed", "failed", "interrupted"])
def test_a_cancel_requested_run_may_only_become_cancelled(
    repo: AgentRunRepository, observer: Conn, t0: datetime, status: str
) -> None:
    run = cancel_requested_run(repo, t0)
    before = read_state(observer, run.id)
    result = repo.set_terminal_status(run.id, status=status, worker_id=OWNER, now=at(t0, 2))
    assert result.changed is False and result.run is not None
    assert result.run.status == RunStatus.CANCEL_REQUESTED
    assert_unchanged(observer, before)


@pytest.mark.parametrize("status", ["failed", "cancelled"])
def test_a_pending_run_can_be_failed_or_cancelled_without_an_owner(
    repo: AgentRunRepository, observer: Conn, t0: datetime, status: str
) -> None:
    run = new_run(repo)
    result = repo.set_terminal_status(
        run.id, status=status, error_type="rejected", error_message="no", now=t0
    )
    assert result.changed and result.run is not None and result.run.status == status
    stored = read_state(observer, run.id)
    assert stored.run is not None
    assert stored.run["status"] == status and stored.run["finished_at"] == t0
    assert (stored.run["error_type"], stored.run["error_message"]) == ("rejected", "no")
    assert stored.attempts == []  # no attempt is invented


def test_a_released_pending_run_can_be_failed_and_its_attempts_stay(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = released_run(repo, t0)
    attempts = read_state(observer, run.id).attempts
    assert repo.set_terminal_status(run.id, status="failed", error_type="gave_up", now=at(t0, 9))[1]
    stored = read_state(observer, run.id)
    assert stored.run is not None and stored.run["status"] == "failed"
    assert stored.attempts == attempts


@pytest.mark.parametrize(
    ("status", "worker_id"),
    [("completed", None), ("interrupted", None), ("failed", OWNER), ("cancelled", OWNER)],
    ids=["completed", "interrupted", "failed-with-worker", "cancelled-with-worker"],
)
def test_a_pending_run_refuses_other_terminal_transitions(
    repo: AgentRunRepository, observer: Conn, t0: datetime, status: str, worker_id: str | None
) -> None:
    run = new_run(repo)
    before = read_state(observer, run.id)
    result = repo.set_terminal_status(run.id, status=status, worker_id=worker_id, now=t0)
    assert result.changed is False and result.run is not None
    assert result.run.status == RunStatus.PENDING
    assert_unchanged(observer, before)


@pytest.mark.parametrize(
    ("worker_id", "seconds"),
    [(None, 1), (OTHER, 1), (OWNER, LEASE), (OWNER, LEASE + 1)],
    ids=["no-worker", "stale-owner", "expired-exactly-at-expiry", "expired-owner"],
)
@pytest.mark.parametrize("status", ["completed", "failed"])
def test_only_the_live_owner_can_finish_a_running_run(
    repo: AgentRunRepository,
    observer: Conn,
    t0: datetime,
    *,
    status: str,
    worker_id: str | None,
    seconds: float,
) -> None:
    run = running_run(repo, t0)
    before = read_state(observer, run.id)
    result = repo.set_terminal_status(
        run.id, status=status, worker_id=worker_id, error_type="x", now=at(t0, seconds)
    )
    assert result.changed is False and result.run is not None
    assert result.run.status == RunStatus.RUNNING
    assert_unchanged(observer, before)


@pytest.mark.parametrize("worker_id", [None, OTHER, OWNER])
@pytest.mark.parametrize("status", TERMINAL)
def test_a_terminal_run_is_never_changed_again(
    repo: AgentRunRepository, observer: Conn, t0: datetime, status: str, worker_id: str | None
) -> None:
    run = running_run(repo, t0)
    assert repo.set_terminal_status(run.id, status="failed", worker_id=OWNER, now=at(t0, 1))[1]
    before = read_state(observer, run.id)
    result = repo.set_terminal_status(run.id, status=status, worker_id=worker_id, now=at(t0, 2))
    assert result.changed is False and result.run is not None
    assert result.run.status == RunStatus.FAILED
    assert_unchanged(observer, before)


def test_set_terminal_status_of_a_missing_run_is_none_unchanged(
    repo: AgentRunRepository, observer: Conn
) -> None:
    assert repo.set_terminal_status("no-such-run", status="failed") == (None, False)
    assert row_counts(observer) == (0, 0)


def test_set_terminal_status_accepts_the_status_enum(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = running_run(repo, t0)
    assert repo.set_terminal_status(
        run.id, status=RunStatus.COMPLETED, worker_id=OWNER, now=at(t0, 1)
    ).changed
    assert read_state(observer, run.id).attempts[0]["outcome"] == "completed"


# --- request_cancel ----------------------------------------------------------------------------


def test_cancelling_a_pending_run_that_never_started_cancels_it_at_once(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = new_run(repo)
    cancelled = repo.request_cancel(run.id, now=t0)
    assert cancelled is not None and cancelled.status == RunStatus.CANCELLED
    stored = read_state(observer, run.id)
    assert stored.run is not None
    assert stored.run["status"] == "cancelled" and stored.run["finished_at"] == t0
    assert stored.run["started_at"] is None
    assert stored.attempts == []  # no attempt is invented


def test_cancelling_a_running_run_asks_its_owner_who_keeps_the_lease(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = running_run(repo, t0)
    requested = repo.request_cancel(run.id, now=at(t0, 1))
    assert requested is not None and requested.status == RunStatus.CANCEL_REQUESTED
    stored = read_state(observer, run.id)
    assert stored.run is not None
    assert stored.run["status"] == "cancel_requested"
    assert stored.run["worker_id"] == OWNER
    assert stored.run["lease_expires_at"] == at(t0, LEASE)
    assert stored.run["finished_at"] is None
    [attempt] = stored.attempts
    assert attempt["finished_at"] is None
    # The owner sees it on its next heartbeat and finishes the run as cancelled.
    assert repo.renew_lease(run.id, worker_id=OWNER, lease_seconds=LEASE, now=at(t0, 2))
    assert repo.get_run(run.id).status == RunStatus.CANCEL_REQUESTED  # type: ignore[union-attr]
    assert repo.set_terminal_status(run.id, status="cancelled", worker_id=OWNER, now=at(t0, 3))[1]
    assert read_state(observer, run.id).attempts[0]["outcome"] == "cancelled"


def test_a_durable_cancel_wins_the_completion_race(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    """Once a cancel is recorded, the owner's late 'completed' is refused; it must cancel."""
    run = running_run(repo, t0)
    repo.request_cancel(run.id, now=at(t0, 1))
    late = repo.set_terminal_status(run.id, status="completed", worker_id=OWNER, now=at(t0, 2))
    assert late.changed is False
    stored = read_state(observer, run.id)
    assert stored.run is not None and stored.run["status"] == "cancel_requested"
    assert stored.attempts[0]["finished_at"] is None
    assert repo.set_terminal_status(run.id, status="cancelled", worker_id=OWNER, now=at(t0, 3))[1]


def test_cancelling_a_released_run_that_had_started_requests_cancel(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = released_run(repo, t0)
    requested = repo.request_cancel(run.id, now=at(t0, 6))
    assert requested is not None and requested.status == RunStatus.CANCEL_REQUESTED
    stored = read_state(observer, run.id)
    assert stored.run is not None
    assert stored.run["status"] == "cancel_requested" and stored.run["worker_id"] is None
    assert stored.run["finished_at"] is None
    assert [a["outcome"] for a in stored.attempts] == ["retry_released"]


@pytest.mark.parametrize("status", TERMINAL)
def test_cancelling_a_terminal_run_changes_nothing(
    repo: AgentRunRepository, observer: Conn, make_run: RunFactory, t0: datetime, status: str
) -> None:
    run = make_run(status=status, finished_at=t0)
    before = read_state(observer, run.id)
    after = repo.request_cancel(run.id, now=at(t0, 1))
    assert after is not None and after.status == status
    assert_unchanged(observer, before)


def test_cancelling_a_missing_run_returns_none(repo: AgentRunRepository, observer: Conn) -> None:
    assert repo.request_cancel("no-such-run") is None
    assert row_counts(observer) == (0, 0)


# --- reconcile_expired_leases ------------------------------------------------------------------


def test_the_reconciler_converges_every_kind_of_lost_run(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    expired_running = running_run(repo, t0)
    expired_cancel = cancel_requested_run(repo, t0)
    ownerless_cancel = released_run(repo, t0)
    repo.request_cancel(ownerless_cancel.id, now=at(t0, 6))
    histories = {
        run_id: read_state(observer, run_id).attempts
        for run_id in (expired_running.id, expired_cancel.id, ownerless_cancel.id)
    }
    now = at(t0, LEASE + 1)
    converged = repo.reconcile_expired_leases(now=now)
    assert {run.id for run in converged} == set(histories)
    for run in converged:
        assert run.status == RunStatus.FAILED and run.error_type == LOST
        assert run.error_message is not None and "at-least-once" in run.error_message
    for run_id, history in histories.items():
        stored = read_state(observer, run_id)
        assert stored.run is not None
        assert stored.run["status"] == "failed"
        assert stored.run["error_type"] == LOST
        assert "at-least-once" in stored.run["error_message"]
        assert stored.run["finished_at"] == now
        assert (stored.run["worker_id"], stored.run["lease_expires_at"]) == (None, None)
        for old, new in zip(history, stored.attempts, strict=True):
            if old["finished_at"] is not None:
                assert new == old  # finished attempts are only read, never rewritten
            else:
                assert new["outcome"] == "lease_expired"
                assert new["error_type"] == LOST
                assert new["finished_at"] == now
        assert all(a["finished_at"] is not None for a in stored.attempts)


def test_a_lease_is_expired_exactly_at_its_expiry(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = running_run(repo, t0)
    assert repo.reconcile_expired_leases(now=at(t0, LEASE - 0.001)) == []
    assert read_state(observer, run.id).run["status"] == "running"  # type: ignore[index]
    [converged] = repo.reconcile_expired_leases(now=at(t0, LEASE))
    assert converged.id == run.id and converged.status == RunStatus.FAILED


def test_the_reconciler_leaves_live_pending_and_terminal_runs_alone(
    repo: AgentRunRepository, observer: Conn, make_run: RunFactory, t0: datetime
) -> None:
    live = running_run(repo, at(t0, 100))
    live_cancel = cancel_requested_run(repo, at(t0, 100))
    never_started = new_run(repo)
    released = released_run(repo, t0)
    unstarted_cancel = make_run(status="cancel_requested")  # claimable, not lost
    terminal = make_run(status="completed", finished_at=t0)
    ids = [live.id, live_cancel.id, never_started.id, released.id, unstarted_cancel.id, terminal.id]
    before = [read_state(observer, run_id) for run_id in ids]
    assert repo.reconcile_expired_leases(now=at(t0, 110)) == []
    assert [read_state(observer, run_id) for run_id in ids] == before


def test_the_reconciler_converges_a_legacy_running_run_without_inventing_attempts(
    repo: AgentRunRepository, observer: Conn, make_run: RunFactory, t0: datetime
) -> None:
    run = make_run(
        status="running",
        worker_id="legacy",
        heartbeat_at=t0,
        lease_expires_at=at(t0, 5),
        started_at=t0,
    )
    [converged] = repo.reconcile_expired_leases(now=at(t0, 10))
    assert converged.id == run.id and converged.status == RunStatus.FAILED
    assert read_state(observer, run.id).attempts == []


def test_the_reconciler_respects_its_limit(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    runs = [running_run(repo, at(t0, i)) for i in range(5)]
    now = at(t0, 100)
    batches = [len(repo.reconcile_expired_leases(now=now, limit=2)) for _ in range(4)]
    assert batches == [2, 2, 1, 0]
    statuses = {read_state(observer, run.id).run["status"] for run in runs}  # type: ignore[index]
    assert statuses == {"failed"}


def test_the_limit_bounds_what_is_written_not_only_what_is_returned(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    for i in range(4):
        running_run(repo, at(t0, i))
    converged = repo.reconcile_expired_leases(now=at(t0, 100), limit=3)
    assert len(converged) == 3
    row = observer.execute(
        "SELECT count(*) FILTER (WHERE status = 'failed'),"
        " count(*) FILTER (WHERE status = 'running') FROM agent_runs"
    ).fetchone()
    assert row == (3, 1)


def test_an_expired_owner_is_refused_everywhere_before_and_after_reconciliation(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = running_run(repo, t0)
    later = at(t0, LEASE + 5)
    manifest = {"tools": ["search"]}

    def stale_owner_is_refused() -> None:
        before = read_state(observer, run.id)
        assert not repo.renew_lease(run.id, worker_id=OWNER, lease_seconds=LEASE, now=later)
        assert not repo.release_lease_for_retry(run.id, worker_id=OWNER, now=later)
        assert not repo.set_terminal_status(
            run.id, status="completed", worker_id=OWNER, now=later
        ).changed
        assert not repo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE, now=later)[1]
        with pytest.raises(NotLeaseOwner):
            repo.record_run_manifest(
                run.id,
                manifest=manifest,
                fingerprint=manifest_fingerprint(manifest),
                worker_id=OWNER,
                now=later,
            )
        assert_unchanged(observer, before)

    stale_owner_is_refused()
    assert [r.id for r in repo.reconcile_expired_leases(now=later)] == [run.id]
    stale_owner_is_refused()


# --- record_run_manifest -----------------------------------------------------------------------


def test_the_live_owner_records_the_manifest_once(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = running_run(repo, t0)
    manifest = {"model": "m-1", "tools": ["search", "code"], "ünï": "☃"}
    fingerprint = manifest_fingerprint(manifest)
    result = repo.record_run_manifest(
        run.id, manifest=manifest, fingerprint=fingerprint, worker_id=OWNER, now=at(t0, 2)
    )
    assert result.changed and result.run is not None
    assert result.run.manifest == manifest and result.run.manifest_fingerprint == fingerprint
    stored = read_state(observer, run.id).run
    assert stored is not None
    assert stored["manifest"] == manifest
    assert stored["manifest_fingerprint"] == fingerprint
    assert stored["manifest_recorded_at"] == at(t0, 2)

    other = {"model": "m-2"}
    before = read_state(observer, run.id)
    again = repo.record_run_manifest(
        run.id,
        manifest=other,
        fingerprint=manifest_fingerprint(other),
        worker_id=OWNER,
        now=at(t0, 3),
    )
    assert again.changed is False and again.run is not None
    assert again.run.manifest == manifest and again.run.manifest_fingerprint == fingerprint
    assert_unchanged(observer, before)


@pytest.mark.parametrize(
    ("state", "worker_id", "seconds"),
    [
        ("running", OTHER, 1),
        ("running", OWNER, LEASE),
        ("running", OWNER, LEASE + 1),
        ("cancel_requested", OWNER, 2),
        ("pending", OWNER, 6),
    ],
    ids=["stale-owner", "expired-at-expiry", "expired", "cancel-requested", "pending"],
)
def test_record_run_manifest_refuses_anyone_but_the_live_owner_of_a_running_run(
    repo: AgentRunRepository,
    observer: Conn,
    t0: datetime,
    *,
    state: str,
    worker_id: str,
    seconds: float,
) -> None:
    make = {"running": running_run, "cancel_requested": cancel_requested_run}.get(
        state, released_run
    )
    run = make(repo, t0)
    before = read_state(observer, run.id)
    manifest = {"model": "m"}
    with pytest.raises(NotLeaseOwner) as caught:
        repo.record_run_manifest(
            run.id,
            manifest=manifest,
            fingerprint=manifest_fingerprint(manifest),
            worker_id=worker_id,
            now=at(t0, seconds),
        )
    assert "lease owner" in str(caught.value)
    assert isinstance(caught.value, ValueError)
    assert_unchanged(observer, before)


def test_record_run_manifest_of_a_missing_run_is_none_unchanged(
    repo: AgentRunRepository, observer: Conn
) -> None:
    manifest = {"a": 1}
    assert repo.record_run_manifest(
        "no-such-run",
        manifest=manifest,
        fingerprint=manifest_fingerprint(manifest),
        worker_id=OWNER,
    ) == (None, False)
    assert row_counts(observer) == (0, 0)


def test_manifest_fingerprint_is_the_sha256_of_canonical_json() -> None:
    manifest = {"b": [1, {"z": None, "y": 2.5}], "a": "é☃"}
    canonical = '{"a":"é☃","b":[1,{"y":2.5,"z":null}]}'
    assert manifest_fingerprint(manifest) == hashlib.sha256(canonical.encode()).hexdigest()
    assert manifest_fingerprint({"a": 1, "b": 2}) == manifest_fingerprint({"b": 2, "a": 1})
    assert canonical == json.dumps(
        manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )


# --- composition into the caller's transaction --------------------------------------------------


def test_calls_inside_a_caller_transaction_that_rolls_back_leave_nothing(
    repo: AgentRunRepository, conn: Conn, observer: Conn, t0: datetime
) -> None:
    kept = running_run(repo, t0)
    before = read_state(observer, kept.id)
    with conn.transaction(force_rollback=True):
        run = new_run(repo)
        assert repo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0).acquired
        assert repo.renew_lease(kept.id, worker_id=OWNER, lease_seconds=LEASE, now=at(t0, 1))
        assert repo.set_terminal_status(run.id, status="completed", worker_id=OWNER, now=t0)[1]
        repo.request_cancel(kept.id, now=at(t0, 2))
        assert row_counts(observer) == (1, 1)  # nothing is visible before the caller commits
    assert row_counts(observer) == (1, 1)
    assert_unchanged(observer, before)


def test_calls_inside_a_caller_transaction_commit_with_it(
    repo: AgentRunRepository, conn: Conn, observer: Conn, t0: datetime
) -> None:
    with conn.transaction():
        run = new_run(repo)
        repo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0)
        assert read_state(observer, run.id).run is None
    stored = read_state(observer, run.id)
    assert stored.run is not None and stored.run["status"] == "running"
    assert len(stored.attempts) == 1


def test_a_refused_call_does_not_abort_the_caller_transaction(
    repo: AgentRunRepository, conn: Conn, observer: Conn
) -> None:
    """Each method is a savepoint inside the caller's transaction: its failure is its own."""
    with conn.transaction():
        first = repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r1")
        with pytest.raises(ThreadBusy):
            repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r2")
        assert repo.get_run(first.id) is not None
        second = repo.create_run(thread_id="t2", agent_slug="a", uid="u", request_id="r3")
    assert {r[0] for r in observer.execute("SELECT id FROM agent_runs").fetchall()} == {
        first.id,
        second.id,
    }


# --- every transition holds the run row lock -----------------------------------------------------


def _transitions(t0: datetime) -> Iterator[tuple[str, Any, Any]]:
    """(name, setup(repo) -> run, call(repo, run)): each a real, permitted transition."""
    manifest = {"m": 1}
    yield (
        "mark_running",
        new_run,
        lambda repo, run: repo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE, now=t0),
    )
    yield (
        "renew_lease",
        lambda repo: running_run(repo, t0),
        lambda repo, run: repo.renew_lease(
            run.id, worker_id=OWNER, lease_seconds=LEASE, now=at(t0, 1)
        ),
    )
    yield (
        "release_lease_for_retry",
        lambda repo: running_run(repo, t0),
        lambda repo, run: repo.release_lease_for_retry(run.id, worker_id=OWNER, now=at(t0, 1)),
    )
    yield (
        "set_terminal_status",
        lambda repo: running_run(repo, t0),
        lambda repo, run: repo.set_terminal_status(
            run.id, status="completed", worker_id=OWNER, now=at(t0, 1)
        ),
    )
    yield (
        "request_cancel",
        lambda repo: running_run(repo, t0),
        lambda repo, run: repo.request_cancel(run.id, now=at(t0, 1)),
    )
    yield (
        "record_run_manifest",
        lambda repo: running_run(repo, t0),
        lambda repo, run: repo.record_run_manifest(
            run.id,
            manifest=manifest,
            fingerprint=manifest_fingerprint(manifest),
            worker_id=OWNER,
            now=at(t0, 1),
        ),
    )
    yield (
        "reconcile_expired_leases",
        lambda repo: running_run(repo, t0),
        lambda repo, run: repo.reconcile_expired_leases(now=at(t0, LEASE + 1)),
    )
    yield (
        "claim_next",
        new_run,
        lambda repo, run: repo.claim_next(worker_id=OWNER, lease_seconds=LEASE, now=t0),
    )


_TRANSITION_NAMES = [name for name, _, _ in _transitions(datetime.now(UTC))]


@pytest.mark.parametrize("name", _TRANSITION_NAMES)
def test_each_transition_locks_the_run_row_in_its_transaction(
    repo: AgentRunRepository, conn: Conn, observer: Conn, t0: datetime, name: str
) -> None:
    [(setup, call)] = [(s, c) for n, s, c in _transitions(t0) if n == name]
    run = setup(repo)
    with conn.transaction():
        call(repo, run)
        with pytest.raises(psycopg.errors.LockNotAvailable):
            observer.execute("SELECT 1 FROM agent_runs WHERE id = %s FOR UPDATE NOWAIT", (run.id,))
    observer.execute("SELECT 1 FROM agent_runs WHERE id = %s FOR UPDATE NOWAIT", (run.id,))
