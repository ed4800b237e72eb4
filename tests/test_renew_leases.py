"""renew_leases: renew_lease for many leases in one statement, with the same rule per lease."""

from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

import agent_runs
from agent_runs import AgentRun, AgentRunRepository, InvalidArgument, RunStatus
from tests.fix_factories import AttemptFactory, RunFactory
from tests.helpers import OTHER, OWNER, State, at, read_state

Conn = psycopg.Connection[Any]

LEASE = 30.0


def running_run(repo: AgentRunRepository, t0: datetime, worker_id: str = OWNER) -> AgentRun:
    """A run claimed by `worker_id` at t0 with a LEASE-second lease (attempt 1 open)."""
    key = uuid.uuid4().hex[:12]
    run = repo.create_run(
        thread_id=f"thread-{key}", agent_slug="agent", uid="user", request_id=f"req-{key}"
    )
    claim = repo.mark_running(run.id, worker_id=worker_id, lease_seconds=LEASE, now=t0)
    assert claim.acquired and claim.run is not None
    return claim.run


def assert_unchanged(observer: Conn, before: State) -> None:
    assert before.run is not None
    assert read_state(observer, before.run["id"]) == before


def assert_renewed(observer: Conn, run_id: str, *, now: datetime, lease_seconds: float) -> None:
    """The run's lease and its one open attempt's lease both moved to `now`."""
    stored = read_state(observer, run_id)
    assert stored.run is not None
    assert stored.run["heartbeat_at"] == now
    assert stored.run["lease_expires_at"] == now + timedelta(seconds=lease_seconds)
    [open_attempt] = [a for a in stored.attempts if a["finished_at"] is None]
    assert open_attempt["worker_id"] == stored.run["worker_id"]
    assert open_attempt["heartbeat_at"] == now
    assert open_attempt["lease_expires_at"] == now + timedelta(seconds=lease_seconds)


def test_renews_every_owned_live_lease_and_returns_their_status(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    runs = [running_run(repo, t0, worker_id=f"worker-{i}:{i:04}") for i in range(3)]
    leases = {run.id: str(run.worker_id) for run in runs}

    renewed = repo.renew_leases(leases, lease_seconds=45, now=at(t0, 10))

    assert renewed == {run.id: RunStatus.RUNNING for run in runs}
    assert all(isinstance(status, RunStatus) for status in renewed.values())
    for run in runs:
        assert_renewed(observer, run.id, now=at(t0, 10), lease_seconds=45)


def test_a_cancel_request_is_seen_in_the_same_round_trip(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    """The owner of a cancel_requested run keeps its lease and learns about the request."""
    running = running_run(repo, t0)
    cancelling = running_run(repo, t0)
    assert repo.request_cancel(cancelling.id, now=at(t0, 1)) is not None

    renewed = repo.renew_leases(
        {running.id: OWNER, cancelling.id: OWNER}, lease_seconds=LEASE, now=at(t0, 5)
    )

    assert renewed == {running.id: RunStatus.RUNNING, cancelling.id: RunStatus.CANCEL_REQUESTED}
    assert_renewed(observer, cancelling.id, now=at(t0, 5), lease_seconds=LEASE)


@pytest.mark.parametrize(
    ("worker_id", "seconds"),
    [(OTHER, 1), (OWNER, LEASE), (OWNER, LEASE + 0.001), (OWNER, 3600)],
    ids=["another-worker", "expired-exactly-at-now", "just-expired", "long-expired"],
)
def test_refused_leases_are_absent_and_nothing_is_written_for_them(
    repo: AgentRunRepository, observer: Conn, t0: datetime, worker_id: str, seconds: float
) -> None:
    """A lease is live only while lease_expires_at > now: at lease_expires_at it has expired."""
    refused = running_run(repo, t0)
    live = running_run(repo, t0, worker_id=worker_id)  # renewed in the same batch
    before = read_state(observer, refused.id)
    now = at(t0, seconds)
    repo.renew_lease(live.id, worker_id=worker_id, lease_seconds=7200, now=t0)  # keep it live

    renewed = repo.renew_leases(
        {refused.id: worker_id, live.id: worker_id}, lease_seconds=LEASE, now=now
    )

    assert renewed == {live.id: RunStatus.RUNNING}
    assert_unchanged(observer, before)
    assert_renewed(observer, live.id, now=now, lease_seconds=LEASE)


def test_pending_terminal_and_missing_runs_are_absent(
    repo: AgentRunRepository, observer: Conn, make_run: RunFactory, t0: datetime
) -> None:
    pending = make_run()
    released = running_run(repo, t0)
    assert repo.release_lease_for_retry(released.id, worker_id=OWNER, now=at(t0, 1))
    completed = make_run(status="completed", started_at=t0, finished_at=at(t0, 2))
    # A pending row carrying a lease (forged) is still not renewable: only running and
    # cancel_requested runs have an owner.
    forged = make_run(
        worker_id=OWNER, heartbeat_at=t0, lease_expires_at=at(t0, 3600), started_at=t0
    )
    run_ids = [pending.id, released.id, completed.id, forged.id]
    before = [read_state(observer, run_id) for run_id in run_ids]

    renewed = repo.renew_leases(
        {**dict.fromkeys(run_ids, OWNER), "no-such-run": OWNER},
        lease_seconds=LEASE,
        now=at(t0, 5),
    )

    assert renewed == {}
    for state in before:
        assert_unchanged(observer, state)


def test_attempts_move_with_their_run_and_history_is_not_touched(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    """Only the owner's open attempt moves; the finished attempt before it stays as it was."""
    run = running_run(repo, t0)
    assert repo.release_lease_for_retry(run.id, worker_id=OWNER, now=at(t0, 5))
    claim = repo.mark_running(run.id, worker_id=OTHER, lease_seconds=LEASE, now=at(t0, 6))
    assert claim.acquired
    first_before = read_state(observer, run.id).attempts[0]

    renewed = repo.renew_leases({run.id: OTHER}, lease_seconds=LEASE, now=at(t0, 20))

    assert renewed == {run.id: RunStatus.RUNNING}
    stored = read_state(observer, run.id)
    assert [a["attempt_no"] for a in stored.attempts] == [1, 2]
    assert stored.attempts[0] == first_before
    assert_renewed(observer, run.id, now=at(t0, 20), lease_seconds=LEASE)


def test_another_workers_open_attempt_is_not_moved(
    repo: AgentRunRepository,
    observer: Conn,
    make_run: RunFactory,
    make_attempt: AttemptFactory,
    t0: datetime,
) -> None:
    """renew_lease's rule: only the open attempt of the lease owner moves with the run."""
    run = make_run(
        status="running",
        worker_id=OWNER,
        heartbeat_at=t0,
        lease_expires_at=at(t0, LEASE),
        started_at=t0,
    )
    stranger = make_attempt(
        run.id, worker_id=OTHER, started_at=t0, heartbeat_at=t0, lease_expires_at=at(t0, LEASE)
    )

    assert repo.renew_leases({run.id: OWNER}, lease_seconds=LEASE, now=at(t0, 10)) == {
        run.id: RunStatus.RUNNING
    }

    stored = read_state(observer, run.id)
    assert stored.run is not None and stored.run["heartbeat_at"] == at(t0, 10)
    [attempt] = stored.attempts
    assert attempt["id"] == stranger.id
    assert attempt["heartbeat_at"] == t0 and attempt["lease_expires_at"] == at(t0, LEASE)


def test_agrees_with_renew_lease_lease_by_lease(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    """The same leases, one batch versus one call each: the same answers and the same rows."""
    batch = [running_run(repo, t0) for _ in range(4)]
    single = [running_run(repo, t0) for _ in range(4)]
    for group in (batch, single):
        assert repo.request_cancel(group[1].id, now=at(t0, 1)) is not None
        assert repo.renew_lease(group[2].id, worker_id=OWNER, lease_seconds=1, now=at(t0, 2))
    owners = [OWNER, OWNER, OWNER, OTHER]
    now = at(t0, 10)  # group[2]'s lease expired at t0 + 3

    renewed = repo.renew_leases(
        {run.id: owner for run, owner in zip(batch, owners, strict=True)},
        lease_seconds=LEASE,
        now=now,
    )
    one_by_one = [
        repo.renew_lease(run.id, worker_id=owner, lease_seconds=LEASE, now=now)
        for run, owner in zip(single, owners, strict=True)
    ]

    assert [run.id in renewed for run in batch] == one_by_one == [True, True, False, False]
    assert [renewed[run.id] for run in batch[:2]] == [
        RunStatus.RUNNING,
        RunStatus.CANCEL_REQUESTED,
    ]

    def shape(run_id: str) -> list[Any]:
        state = read_state(observer, run_id)
        assert state.run is not None
        leases = [(a["heartbeat_at"], a["lease_expires_at"]) for a in state.attempts]
        run = state.run
        return [run["status"], run["heartbeat_at"], run["lease_expires_at"], leases]

    assert [shape(run.id) for run in batch] == [shape(run.id) for run in single]


def test_an_empty_batch_renews_nothing(repo: AgentRunRepository) -> None:
    assert repo.renew_leases({}, lease_seconds=LEASE) == {}


def test_the_database_clock_is_used_when_now_is_not_given(
    repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = running_run(repo, datetime.now(t0.tzinfo))
    renewed = repo.renew_leases({run.id: OWNER}, lease_seconds=LEASE)
    assert renewed == {run.id: RunStatus.RUNNING}
    stored = read_state(observer, run.id)
    assert stored.run is not None and run.heartbeat_at is not None
    assert stored.run["heartbeat_at"] > run.heartbeat_at


@pytest.mark.parametrize(
    "case",
    [
        ({"run": ""}, LEASE, "worker_id"),
        ({"run": "w\x00"}, LEASE, "worker_id"),
        ({"": OWNER}, LEASE, "run_id"),
        ({"r" * 65: OWNER}, LEASE, "run_id"),
        ({"run": OWNER}, 0, "lease_seconds"),
        ({"run": OWNER}, float("nan"), "lease_seconds"),
        ([("run", OWNER)], LEASE, "leases"),
    ],
)
def test_bad_input_is_refused_by_name_before_any_sql(
    repo: AgentRunRepository, observer: Conn, t0: datetime, case: tuple[Any, float, str]
) -> None:
    leases, lease_seconds, needle = case
    run = running_run(repo, t0)
    before = read_state(observer, run.id)
    with pytest.raises(InvalidArgument, match=needle):
        repo.renew_leases(leases, lease_seconds=lease_seconds, now=at(t0, 1))
    assert_unchanged(observer, before)


def test_inside_a_callers_transaction_it_composes_and_rolls_back_with_it(
    conn: Conn, repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    run = running_run(repo, t0)
    before = read_state(observer, run.id)
    with conn.transaction(force_rollback=True):
        assert repo.renew_leases({run.id: OWNER}, lease_seconds=LEASE, now=at(t0, 9)) == {
            run.id: RunStatus.RUNNING
        }
    assert_unchanged(observer, before)


def test_overlapping_batches_in_opposite_orders_never_deadlock(
    dsn: str, repo: AgentRunRepository, t0: datetime
) -> None:
    """Rows are locked in id order whatever the mapping's order, so batches cannot deadlock."""
    runs = [running_run(repo, t0) for _ in range(20)]
    now = at(t0, 1)
    forward = {run.id: OWNER for run in runs}
    backward = dict(reversed(forward.items()))
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def renew(leases: dict[str, str]) -> None:
        try:
            with agent_runs.connect(dsn) as connection:
                mine = AgentRunRepository(connection)
                start.wait(timeout=30)
                for _ in range(60):
                    assert len(mine.renew_leases(leases, lease_seconds=LEASE, now=now)) == 20
        except BaseException as exc:  # reported below, with the deadlock if there was one
            errors.append(exc)

    threads = [threading.Thread(target=renew, args=(order,)) for order in (forward, backward)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors


def test_a_batch_waits_for_its_first_run_in_id_order_before_it_holds_any_other(
    dsn: str, repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    """Another batch holds the batch's lowest id (and will take the rest in id order): the batch
    must wait there holding nothing. Locking in the plan's order (a table scan's, where the
    lowest id was written last) would hold the others first and deadlock with it."""
    for _ in range(3):
        runs = sorted((running_run(repo, t0) for _ in range(12)), key=lambda run: run.id)
        # Moved to the end of its page (a HOT update writes a new version): last in a scan.
        assert repo.renew_lease(runs[0].id, worker_id=OWNER, lease_seconds=LEASE, now=t0)
        backward = {run.id: OWNER for run in reversed(runs)}
        assert _renew_behind_a_holder(dsn, observer, backward, now=at(t0, 1)) == dict.fromkeys(
            backward, RunStatus.RUNNING
        )


def _renew_behind_a_holder(
    dsn: str, observer: Conn, leases: dict[str, str], *, now: datetime
) -> dict[str, RunStatus]:
    """renew_leases(leases) while another transaction holds the lowest run id, and takes every
    run of `leases` (in id order) once the batch waits; the batch's answer."""
    answers: list[dict[str, RunStatus]] = []
    errors: list[BaseException] = []
    with agent_runs.connect(dsn) as holder_conn, agent_runs.connect(dsn) as contender_conn:
        holder, contender = AgentRunRepository(holder_conn), AgentRunRepository(contender_conn)

        def renew() -> None:
            try:
                answers.append(contender.renew_leases(leases, lease_seconds=LEASE, now=now))
            except BaseException as exc:  # reported below, with the deadlock if there was one
                errors.append(exc)

        with holder_conn.transaction():
            assert holder.renew_lease(min(leases), worker_id=OWNER, lease_seconds=LEASE, now=now)
            thread = threading.Thread(target=renew)
            thread.start()
            _wait_until_blocked(observer, contender_conn.info.backend_pid)
            assert len(holder.renew_leases(leases, lease_seconds=LEASE, now=now)) == len(leases)
        thread.join(timeout=30)
    assert not errors, errors
    [answer] = answers
    return answer


def _wait_until_blocked(observer: Conn, pid: int) -> None:
    """Until the backend `pid` waits for a lock (a row another transaction holds)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        row = observer.execute(
            "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone()
        if row is not None and row[0] == "Lock":
            return
        time.sleep(0.01)
    raise AssertionError(f"backend {pid} never waited for a lock")


def test_keeps_working_after_the_session_forgets_its_prepared_statements(
    conn: Conn, repo: AgentRunRepository, observer: Conn, t0: datetime
) -> None:
    """DISCARD ALL (or a pooler handing us another server session) drops prepared statements:
    the call still renews, and the next one prepares the statement again."""
    run = running_run(repo, t0)
    assert repo.renew_leases({run.id: OWNER}, lease_seconds=LEASE, now=at(t0, 1))
    conn.execute("DISCARD ALL")

    assert repo.renew_leases({run.id: OWNER}, lease_seconds=LEASE, now=at(t0, 2)) == {
        run.id: RunStatus.RUNNING
    }
    assert_renewed(observer, run.id, now=at(t0, 2), lease_seconds=LEASE)
    assert repo.renew_leases({run.id: OWNER}, lease_seconds=LEASE, now=at(t0, 3))
    assert_renewed(observer, run.id, now=at(t0, 3), lease_seconds=LEASE)
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
