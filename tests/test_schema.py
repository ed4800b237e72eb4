"""The schema: every invariant is enforced by PostgreSQL itself."""

from __future__ import annotations

import re
import uuid
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest
from psycopg import errors

from agent_runs import AgentRunRepository, RunAttempt
from agent_runs.errors import (
    UQ_ONE_ACTIVE_PER_THREAD,
    UQ_ONE_OPEN_ATTEMPT,
    UQ_REQUEST_ID,
    UQ_RUN_ATTEMPT_NO,
)
from tests.fix_factories import AttemptFactory, RunFactory
from tests.helpers import read_state, row_counts

Conn = psycopg.Connection[Any]

TIMESTAMP_COLUMNS = {
    "agent_runs": {
        "heartbeat_at",
        "lease_expires_at",
        "manifest_recorded_at",
        "started_at",
        "finished_at",
        "created_at",
        "updated_at",
    },
    "agent_run_attempts": {
        "started_at",
        "heartbeat_at",
        "lease_expires_at",
        "finished_at",
        "created_at",
        "updated_at",
    },
}


def _columns(observer: Conn, table: str) -> dict[str, tuple[str, bool]]:
    rows = observer.execute(
        "SELECT column_name, data_type, is_nullable = 'YES' FROM information_schema.columns"
        " WHERE table_schema = current_schema() AND table_name = %s",
        (table,),
    ).fetchall()
    return {name: (data_type, nullable) for name, data_type, nullable in rows}


def _insert_run(observer: Conn, **cols: Any) -> None:
    key = uuid.uuid4().hex
    values: dict[str, Any] = {
        "id": key,
        "request_id": f"req-{key}",
        "thread_id": f"t-{key}",
        "agent_slug": "agent",
        "uid": "user",
    }
    values.update(cols)
    names = ", ".join(values)
    marks = ", ".join(f"%({n})s" for n in values)
    observer.execute(f"INSERT INTO agent_runs ({names}) VALUES ({marks})", values)  # noqa: S608


# --- agent_runs --------------------------------------------------------------------------------


def test_agent_runs_has_the_specified_columns_and_types(observer: Conn) -> None:
    columns = _columns(observer, "agent_runs")
    assert set(columns) == {
        "id",
        "request_id",
        "thread_id",
        "agent_slug",
        "uid",
        "run_type",
        "created_by_run_id",
        "status",
        "input_payload",
        "error_type",
        "error_message",
        "worker_id",
        "heartbeat_at",
        "lease_expires_at",
        "manifest",
        "manifest_fingerprint",
        "manifest_recorded_at",
        "started_at",
        "finished_at",
        "created_at",
        "updated_at",
        "trace_context",  # 0010, agent_runs.telemetry
        "priority",  # 0013, the claim order
        "available_at",
        "output",  # 0015, the run's result
        "concurrency_key",  # 0017, limits per key
        "key_waiting",  # 0018, a full key's waiting runs out of the claim index
    }
    assert columns["trace_context"] == ("jsonb", True)
    assert columns["priority"] == ("smallint", False)
    assert columns["available_at"] == ("timestamp with time zone", False)
    assert columns["output"] == ("jsonb", True)
    for name in TIMESTAMP_COLUMNS["agent_runs"]:
        assert columns[name][0] == "timestamp with time zone", name
    assert columns["input_payload"] == ("jsonb", False)
    assert columns["manifest"][0] == "jsonb"
    for name in ("id", "request_id", "thread_id", "agent_slug", "uid", "run_type", "status"):
        assert columns[name] == ("text", False), name
    assert columns["created_by_run_id"] == ("text", True)


def test_a_minimal_insert_gets_the_specified_defaults(observer: Conn, make_run: RunFactory) -> None:
    run = make_run()
    assert run.status == "pending"
    assert run.run_type == "chat"
    assert run.input_payload == {}
    assert run.created_at is not None
    assert run.worker_id is None and run.heartbeat_at is None and run.lease_expires_at is None


@pytest.mark.parametrize(
    ("cols", "constraint_fragment"),
    [
        ({"status": "paused"}, "status"),
        ({"run_type": "batch"}, "run_type"),
        ({"worker_id": "w"}, "lease"),
        ({"worker_id": "w", "heartbeat_at": "2024-01-01T00:00:00Z"}, "lease"),
        ({"lease_expires_at": "2024-01-01T00:00:00Z"}, "lease"),
        ({"status": "completed"}, ""),
        (
            {
                "status": "failed",
                "finished_at": "2024-01-01T00:00:00Z",
                "worker_id": "w",
                "heartbeat_at": "2024-01-01T00:00:00Z",
                "lease_expires_at": "2024-01-01T00:01:00Z",
            },
            "",
        ),
        ({"status": "running"}, ""),
    ],
    ids=[
        "unknown-status",
        "unknown-run-type",
        "owner-without-heartbeat-and-expiry",
        "owner-and-heartbeat-without-expiry",
        "expiry-without-owner",
        "terminal-without-finished-at",
        "terminal-with-a-lease",
        "running-without-a-lease",
    ],
)
def test_check_constraints_refuse_a_dishonest_run_row(
    observer: Conn, cols: dict[str, Any], constraint_fragment: str
) -> None:
    before = row_counts(observer)
    with pytest.raises(errors.CheckViolation) as caught:
        _insert_run(observer, **cols)
    assert constraint_fragment in (caught.value.diag.constraint_name or "")
    assert row_counts(observer) == before


def test_an_honest_terminal_and_running_row_are_accepted(observer: Conn) -> None:
    _insert_run(observer, status="completed", finished_at="2024-01-01T00:00:00Z")
    _insert_run(
        observer,
        status="running",
        worker_id="w",
        heartbeat_at="2024-01-01T00:00:00Z",
        lease_expires_at="2024-01-01T00:01:00Z",
        started_at="2024-01-01T00:00:00Z",
    )
    assert row_counts(observer) == (2, 0)


def test_request_id_is_unique(observer: Conn, make_run: RunFactory) -> None:
    make_run(request_id="same", status="completed", finished_at="2024-01-01T00:00:00Z")
    with pytest.raises(errors.UniqueViolation) as caught:
        make_run(request_id="same", status="completed", finished_at="2024-01-01T00:00:00Z")
    assert caught.value.diag.constraint_name == UQ_REQUEST_ID


@pytest.mark.parametrize("second_status", ["pending", "running", "cancel_requested"])
def test_only_one_non_terminal_run_per_thread(
    observer: Conn, make_run: RunFactory, second_status: str
) -> None:
    make_run(uid="u", agent_slug="a", thread_id="t")
    lease = {}
    if second_status != "pending":
        lease = {
            "worker_id": "w",
            "heartbeat_at": "2024-01-01T00:00:00Z",
            "lease_expires_at": "2024-01-01T00:01:00Z",
        }
    with pytest.raises(errors.UniqueViolation) as caught:
        make_run(uid="u", agent_slug="a", thread_id="t", status=second_status, **lease)
    assert caught.value.diag.constraint_name == UQ_ONE_ACTIVE_PER_THREAD


def test_terminal_runs_and_other_threads_do_not_make_a_thread_busy(
    observer: Conn, make_run: RunFactory
) -> None:
    for status in ("completed", "failed", "cancelled", "interrupted"):
        make_run(uid="u", agent_slug="a", thread_id="t", status=status, finished_at="2024-01-01Z")
    make_run(uid="u", agent_slug="a", thread_id="t")
    make_run(uid="u", agent_slug="a", thread_id="t2")
    make_run(uid="u", agent_slug="b", thread_id="t")
    make_run(uid="v", agent_slug="a", thread_id="t")
    assert row_counts(observer) == (8, 0)


def test_deleting_a_parent_run_sets_created_by_run_id_to_null(
    observer: Conn, make_run: RunFactory, repo: AgentRunRepository
) -> None:
    parent = make_run()
    child = make_run(created_by_run_id=parent.id, run_type="subagent")
    assert child.created_by_run_id == parent.id
    observer.execute("DELETE FROM agent_runs WHERE id = %s", (parent.id,))
    after = read_state(observer, child.id).run
    assert after is not None and after["created_by_run_id"] is None


def test_created_by_run_id_must_name_an_existing_run(observer: Conn, make_run: RunFactory) -> None:
    with pytest.raises(errors.ForeignKeyViolation):
        make_run(created_by_run_id="no-such-run")


# --- agent_run_attempts ------------------------------------------------------------------------


def test_agent_run_attempts_has_the_specified_columns_and_types(observer: Conn) -> None:
    columns = _columns(observer, "agent_run_attempts")
    assert set(columns) == {
        "id",
        "run_id",
        "attempt_no",
        "worker_id",
        "started_at",
        "heartbeat_at",
        "lease_expires_at",
        "finished_at",
        "outcome",
        "error_type",
        "error_message",
        "created_at",
        "updated_at",
        "retry_at",  # 0013, the recovery policy's decision
        "resumed_from",  # 0015, a checkpointed execution's resume point
        "resumed_step",
    }
    assert columns["resumed_from"] == ("text", True)
    assert columns["resumed_step"] == ("integer", True)
    for name in TIMESTAMP_COLUMNS["agent_run_attempts"]:
        assert columns[name][0] == "timestamp with time zone", name
    assert columns["id"] == ("bigint", False)
    assert columns["attempt_no"] == ("integer", False)
    assert columns["run_id"] == ("text", False)
    assert columns["worker_id"] == ("text", False)
    assert columns["started_at"][1] is False
    assert columns["finished_at"][1] is True
    identity = observer.execute(
        "SELECT is_identity FROM information_schema.columns"
        " WHERE table_name = 'agent_run_attempts' AND column_name = 'id'"
    ).fetchone()
    assert identity == ("YES",)


def test_a_duplicate_attempt_no_is_rejected_by_the_database(
    observer: Conn, make_run: RunFactory, make_attempt: AttemptFactory
) -> None:
    run = make_run()
    make_attempt(run.id, attempt_no=1, finished_at="2024-01-01Z", outcome="retry_released")
    with pytest.raises(errors.UniqueViolation) as caught:
        make_attempt(run.id, attempt_no=1)
    assert caught.value.diag.constraint_name == UQ_RUN_ATTEMPT_NO
    assert len(read_state(observer, run.id).attempts) == 1


def test_a_second_open_attempt_of_a_run_is_rejected_by_the_database(
    observer: Conn, make_run: RunFactory, make_attempt: AttemptFactory
) -> None:
    run = make_run()
    make_attempt(run.id, attempt_no=1)
    with pytest.raises(errors.UniqueViolation) as caught:
        make_attempt(run.id, attempt_no=2)
    assert caught.value.diag.constraint_name == UQ_ONE_OPEN_ATTEMPT
    assert len(read_state(observer, run.id).attempts) == 1


def test_open_attempts_of_different_runs_coexist(
    observer: Conn, make_run: RunFactory, make_attempt: AttemptFactory
) -> None:
    first, second = make_run(), make_run()
    make_attempt(first.id)
    make_attempt(second.id)
    assert row_counts(observer) == (2, 2)


@pytest.mark.parametrize(
    "cols",
    [
        {"attempt_no": 0},
        {"attempt_no": -1},
        {"outcome": "completed"},
        {"finished_at": "2024-01-01Z"},
        {"finished_at": "2024-01-01Z", "outcome": "exploded"},
        {"finished_at": "2024-01-01Z", "outcome": "running"},
    ],
    ids=[
        "attempt-no-zero",
        "attempt-no-negative",
        "outcome-without-finished-at",
        "finished-at-without-outcome",
        "unknown-outcome",
        "run-status-is-not-an-outcome",
    ],
)
def test_check_constraints_refuse_a_dishonest_attempt_row(
    observer: Conn, make_run: RunFactory, make_attempt: AttemptFactory, cols: dict[str, Any]
) -> None:
    run = make_run()
    with pytest.raises(errors.CheckViolation):
        make_attempt(run.id, **cols)
    assert row_counts(observer) == (1, 0)


@pytest.mark.parametrize(
    "outcome",
    ["completed", "failed", "cancelled", "interrupted", "retry_released", "lease_expired"],
)
def test_every_outcome_of_the_spec_is_accepted(
    make_run: RunFactory, make_attempt: AttemptFactory, outcome: str
) -> None:
    run = make_run()
    attempt = make_attempt(run.id, finished_at="2024-01-01Z", outcome=outcome)
    assert attempt.outcome == outcome


def _finished_attempt(make_run: RunFactory, make_attempt: AttemptFactory) -> RunAttempt:
    run = make_run()
    return make_attempt(
        run.id,
        finished_at="2024-01-01T00:05:00Z",
        outcome="failed",
        error_type="boom",
        error_message="it broke",
    )


def _names_the_attempt(message: str, attempt: RunAttempt) -> bool:
    return bool(re.search(rf"\b{attempt.id}\b", message)) and attempt.run_id in message


@pytest.mark.parametrize(
    "assignment",
    [
        "outcome = outcome",  # a no-op UPDATE is refused too
        "updated_at = updated_at",
        "outcome = 'completed'",
        "error_message = 'rewritten history'",
        "error_type = NULL",
        "finished_at = finished_at + interval '1 second'",
        "heartbeat_at = now()",
        "lease_expires_at = now()",
        "finished_at = NULL, outcome = NULL",
    ],
)
def test_a_finished_attempt_refuses_every_update_naming_the_attempt(
    observer: Conn, make_run: RunFactory, make_attempt: AttemptFactory, assignment: str
) -> None:
    attempt = _finished_attempt(make_run, make_attempt)
    before = read_state(observer, attempt.run_id)
    with pytest.raises(psycopg.DatabaseError) as caught:
        observer.execute(
            f"UPDATE agent_run_attempts SET {assignment} WHERE id = %s",  # noqa: S608
            (attempt.id,),
        )
    assert _names_the_attempt(str(caught.value), attempt), str(caught.value)
    assert read_state(observer, attempt.run_id) == before


@pytest.mark.parametrize(
    "assignment",
    [
        "run_id = %(other_run)s",
        "attempt_no = attempt_no + 1",
        "worker_id = 'someone-else'",
        "started_at = started_at - interval '1 hour'",
    ],
)
def test_an_open_attempt_never_changes_its_identity(
    observer: Conn, make_run: RunFactory, make_attempt: AttemptFactory, assignment: str
) -> None:
    run, other = make_run(), make_run()
    attempt = make_attempt(run.id)
    before = read_state(observer, run.id)
    with pytest.raises(psycopg.DatabaseError) as caught:
        observer.execute(
            f"UPDATE agent_run_attempts SET {assignment} WHERE id = %(id)s",  # noqa: S608
            {"id": attempt.id, "other_run": other.id},
        )
    assert _names_the_attempt(str(caught.value), attempt), str(caught.value)
    assert read_state(observer, run.id) == before
    assert read_state(observer, other.id).attempts == []


@pytest.mark.parametrize(
    "assignment",
    ["error_type = 'x'", "error_message = 'x'"],
)
def test_an_open_attempt_cannot_record_a_failure_without_finishing(
    observer: Conn, make_run: RunFactory, make_attempt: AttemptFactory, assignment: str
) -> None:
    run = make_run()
    attempt = make_attempt(run.id)
    before = read_state(observer, run.id)
    with pytest.raises(psycopg.DatabaseError):
        observer.execute(
            f"UPDATE agent_run_attempts SET {assignment} WHERE id = %s",  # noqa: S608
            (attempt.id,),
        )
    assert read_state(observer, run.id) == before


def test_an_open_attempt_may_renew_its_lease_then_finish_exactly_once(
    observer: Conn, make_run: RunFactory, make_attempt: AttemptFactory
) -> None:
    run = make_run()
    attempt = make_attempt(run.id)
    observer.execute(
        "UPDATE agent_run_attempts SET heartbeat_at = now(),"
        " lease_expires_at = now() + interval '30 seconds' WHERE id = %s",
        (attempt.id,),
    )
    observer.execute(
        "UPDATE agent_run_attempts SET finished_at = now(), outcome = 'failed',"
        " error_type = 'boom', error_message = 'it broke' WHERE id = %s",
        (attempt.id,),
    )
    stored = read_state(observer, run.id).attempts[0]
    assert stored["outcome"] == "failed" and stored["error_type"] == "boom"
    with pytest.raises(psycopg.DatabaseError):
        observer.execute(
            "UPDATE agent_run_attempts SET finished_at = now(), outcome = 'completed'"
            " WHERE id = %s",
            (attempt.id,),
        )
    assert read_state(observer, run.id).attempts[0] == stored


def test_deleting_an_attempt_is_refused_while_its_run_exists(
    observer: Conn, make_run: RunFactory, make_attempt: AttemptFactory
) -> None:
    run = make_run()
    open_attempt = make_attempt(run.id, attempt_no=2)
    finished = make_attempt(run.id, attempt_no=1, finished_at="2024-01-01Z", outcome="failed")
    for attempt in (open_attempt, finished):
        with pytest.raises(psycopg.DatabaseError) as caught:
            observer.execute("DELETE FROM agent_run_attempts WHERE id = %s", (attempt.id,))
        assert _names_the_attempt(str(caught.value), attempt), str(caught.value)
    assert len(read_state(observer, run.id).attempts) == 2


def test_deleting_a_run_removes_its_attempts(
    observer: Conn, make_run: RunFactory, make_attempt: AttemptFactory
) -> None:
    run, kept = make_run(), make_run()
    make_attempt(run.id, attempt_no=1, finished_at="2024-01-01Z", outcome="retry_released")
    make_attempt(run.id, attempt_no=2)
    make_attempt(kept.id)
    observer.execute("DELETE FROM agent_runs WHERE id = %s", (run.id,))
    assert read_state(observer, run.id) == read_state(observer, "no-such-run")
    assert row_counts(observer) == (1, 1)


# --- indexes and storage -----------------------------------------------------------------------


def _index_definitions(observer: Conn, table: str) -> dict[str, str]:
    rows = observer.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s", (table,)
    ).fetchall()
    return dict(rows)


def test_lease_columns_are_not_indexed_so_renewals_can_be_hot(observer: Conn) -> None:
    rows = observer.execute(
        """
        SELECT c.relname, i.indexrelid::regclass::text,
               pg_get_indexdef(i.indexrelid)
        FROM pg_index i JOIN pg_class c ON c.oid = i.indrelid
        WHERE c.relname IN ('agent_runs', 'agent_run_attempts')
        """
    ).fetchall()
    assert rows
    for table, index, definition in rows:
        for column in ("heartbeat_at", "lease_expires_at", "updated_at"):
            assert column not in definition, f"{table}.{index} indexes {column}: {definition}"


@pytest.mark.parametrize("table", ["agent_runs", "agent_run_attempts"])
def test_tables_leave_free_space_in_pages_for_hot_updates(observer: Conn, table: str) -> None:
    row = observer.execute(
        "SELECT reloptions FROM pg_class WHERE relname = %s AND relkind = 'r'", (table,)
    ).fetchone()
    assert row is not None
    options = dict(opt.split("=", 1) for opt in (row[0] or []))
    assert 50 <= int(options.get("fillfactor", "100")) < 100, options


def test_claim_index_matches_the_claim_order(observer: Conn) -> None:
    definitions = _index_definitions(observer, "agent_runs")
    claimable = [d for d in definitions.values() if "(priority, available_at, id)" in d]
    # Its predicate admits pending runs and ownerless cancel requests.
    assert any("'pending'" in d and "worker_id IS NULL" in d for d in claimable), definitions


def test_one_active_run_per_thread_is_a_partial_unique_index(observer: Conn) -> None:
    definition = _index_definitions(observer, "agent_runs")[UQ_ONE_ACTIVE_PER_THREAD]
    assert definition.startswith("CREATE UNIQUE INDEX")
    assert "WHERE" in definition
    for column in ("uid", "agent_slug", "thread_id"):
        assert column in definition


def test_one_open_attempt_per_run_is_a_partial_unique_index(observer: Conn) -> None:
    definition = _index_definitions(observer, "agent_run_attempts")[UQ_ONE_OPEN_ATTEMPT]
    assert definition.startswith("CREATE UNIQUE INDEX")
    assert "(run_id)" in definition and "finished_at IS NULL" in definition


def test_a_lease_renewal_is_a_hot_update_of_run_and_attempt(
    conn: Conn, repo: AgentRunRepository, t0: datetime
) -> None:
    """Heartbeats are the most frequent write: they must not touch any index."""
    run = repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r")
    assert repo.mark_running(run.id, worker_id="w", lease_seconds=30, now=t0).acquired

    def counts(table: str) -> tuple[int, int]:
        row = conn.execute(
            "SELECT pg_stat_get_xact_tuples_updated(%s::regclass),"
            " pg_stat_get_xact_tuples_hot_updated(%s::regclass)",
            (table, table),
        ).fetchone()
        assert row is not None
        return int(row[0]), int(row[1])

    tables = ("agent_runs", "agent_run_attempts")
    # The backend's pending counters also hold earlier, unflushed work: compare deltas taken
    # inside one transaction (nothing is flushed while it is open).
    with conn.transaction(force_rollback=True):
        before = {table: counts(table) for table in tables}
        assert repo.renew_lease(
            run.id, worker_id="w", lease_seconds=30, now=t0 + timedelta(seconds=10)
        )
        for table in tables:
            updated = counts(table)[0] - before[table][0]
            hot = counts(table)[1] - before[table][1]
            assert updated == 1, f"{table}: {updated} rows updated by one renewal"
            assert hot == updated, f"{table}: {updated} updates, only {hot} HOT"


def test_the_update_guard_fires_after_and_only_for_forbidden_changes(observer: Conn) -> None:
    """A BEFORE UPDATE trigger would lock every renewed row first: the guard is AFTER … WHEN."""
    rows = observer.execute(
        "SELECT tgname, pg_get_triggerdef(oid) FROM pg_trigger"
        " WHERE tgrelid = 'agent_run_attempts'::regclass AND NOT tgisinternal"
    ).fetchall()
    definitions = dict(rows)
    updates = [d for d in definitions.values() if "UPDATE" in d]
    # 0005's guard, and 0015's write-once guard of the resume point
    assert len(updates) == 2, definitions
    for update in updates:
        assert "AFTER UPDATE" in update and "WHEN" in update, update
    deletes = [d for d in definitions.values() if "DELETE" in d]
    assert len(deletes) == 1 and "BEFORE DELETE" in deletes[0], definitions


def test_no_update_of_either_table_fires_a_before_update_row_trigger(observer: Conn) -> None:
    """PostgreSQL locks a row (a WAL record) before any BEFORE UPDATE row trigger, whatever its
    column list: every guard that sees updates is AFTER UPDATE … WHEN."""
    rows = observer.execute(
        "SELECT tgrelid::regclass::text, pg_get_triggerdef(oid) FROM pg_trigger"
        " WHERE tgrelid IN ('agent_runs'::regclass, 'agent_run_attempts'::regclass)"
        " AND NOT tgisinternal"
    ).fetchall()
    definitions = [definition for _, definition in rows]
    assert {table for table, _ in rows} == {"agent_runs", "agent_run_attempts"}, definitions
    for definition in definitions:
        if "UPDATE" in definition:
            assert "AFTER UPDATE" in definition and "WHEN" in definition, definition
        else:  # an AFTER INSERT/DELETE trigger only where its WHEN holds (limits per key)
            assert (
                "BEFORE INSERT" in definition
                or "BEFORE DELETE" in definition
                or ("AFTER" in definition and "WHEN" in definition)
            ), definition


def test_a_statement_updating_one_finished_and_one_open_attempt_changes_neither(
    observer: Conn, make_run: RunFactory, make_attempt: AttemptFactory
) -> None:
    finished = _finished_attempt(make_run, make_attempt)
    run = make_run()
    open_attempt = make_attempt(run.id)
    before = (read_state(observer, finished.run_id), read_state(observer, run.id))
    with pytest.raises(errors.RestrictViolation) as caught:
        observer.execute(
            "UPDATE agent_run_attempts SET heartbeat_at = now() WHERE id = ANY(%s)",
            ([finished.id, open_attempt.id],),
        )
    assert _names_the_attempt(str(caught.value), finished), str(caught.value)
    assert (read_state(observer, finished.run_id), read_state(observer, run.id)) == before
