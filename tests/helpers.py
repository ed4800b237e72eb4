"""Helpers shared by test modules (not fixtures): read real state back through a plain
connection, create runs through the repository, move the clock, wait for a condition."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row

from agent_runs import AgentRun, AgentRunRepository, AgentRunsError, InvalidArgument, connect

# The worker id tests lease runs with, and a second one that does not own them.
OWNER: Final = "worker-a:0001"
OTHER: Final = "worker-b:0002"


def at(t0: datetime, seconds: float) -> datetime:
    """The instant `seconds` after `t0`: tests move the clock with `now=at(t0, 5)`."""
    return t0 + timedelta(seconds=seconds)


def wait_until(predicate: Callable[[], bool], *, timeout: float = 10.0) -> bool:
    """Poll `predicate` until it holds (returns True); AssertionError when `timeout` passes."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)
    return True


@dataclass(frozen=True)
class State:
    """Everything the database holds about one run: its row and its attempt rows, as dicts."""

    run: dict[str, Any] | None
    attempts: list[dict[str, Any]]


def read_state(connection: psycopg.Connection[Any], run_id: str) -> State:
    """The run and its attempts as stored (read with plain SQL, not through the repository)."""
    with connection.cursor(row_factory=dict_row) as cur:
        run = cur.execute("SELECT * FROM agent_runs WHERE id = %s", (run_id,)).fetchone()
        attempts = cur.execute(
            "SELECT * FROM agent_run_attempts WHERE run_id = %s ORDER BY attempt_no", (run_id,)
        ).fetchall()
    return State(run=run, attempts=attempts)


def row_counts(connection: psycopg.Connection[Any]) -> tuple[int, int]:
    """(rows in agent_runs, rows in agent_run_attempts)."""
    row = connection.execute(
        "SELECT (SELECT count(*) FROM agent_runs), (SELECT count(*) FROM agent_run_attempts)"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def wait_for_lock_waiters(
    connection: psycopg.Connection[Any], count: int, *, timeout: float = 10.0
) -> None:
    """Block until `count` other sessions of this database are waiting on a heavyweight lock."""
    deadline = time.monotonic() + timeout
    waiting = 0
    while time.monotonic() < deadline:
        # Inside a transaction the activity view is a cached snapshot: refresh it each time.
        connection.execute("SELECT pg_stat_clear_snapshot()")
        row = connection.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'"
        ).fetchone()
        waiting = int(row[0]) if row else 0
        if waiting >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"expected {count} sessions waiting on a lock, saw {waiting}")


def new_run(repo: AgentRunRepository, **kwargs: Any) -> AgentRun:
    """A pending run created through the repository, with unique ids unless given."""
    key = uuid.uuid4().hex[:12]
    values: dict[str, Any] = {
        "thread_id": f"thread-{key}",
        "agent_slug": "agent",
        "uid": "user",
        "request_id": f"req-{key}",
    }
    values.update(kwargs)
    return repo.create_run(**values)


def enqueue(
    repo: AgentRunRepository,
    script: list[str] | None = None,
    *,
    agent_slug: str = "agent",
    **payload: Any,
) -> AgentRun:
    """A pending run whose input payload carries `script` (the scripted agents read it)."""
    if script is not None:
        payload["script"] = script
    return new_run(repo, agent_slug=agent_slug, input_payload=payload)


# -- refusals of bad input ------------------------------------------------------------------------


@dataclass(frozen=True)
class Runs:
    """The rows a bad call could damage: a pending run and a running run owned by OWNER."""

    pending: str
    running: str
    now: datetime


Call = Callable[[AgentRunRepository, Runs], object]


def everything(
    observer: psycopg.Connection[Any],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every row of both tables, in id order."""
    with observer.cursor(row_factory=dict_row) as cur:
        runs = cur.execute("SELECT * FROM agent_runs ORDER BY id").fetchall()
        attempts = cur.execute("SELECT * FROM agent_run_attempts ORDER BY id").fetchall()
    return runs, attempts


def assert_refused_writing_nothing(
    repo: AgentRunRepository,
    observer: psycopg.Connection[Any],
    runs: Runs,
    argument: str,
    call: Call,
) -> None:
    """`call` raises InvalidArgument naming `argument`, changes no row and leaves no
    transaction open."""
    before = everything(observer)
    try:
        call(repo, runs)
    except InvalidArgument as refused:
        assert argument in str(refused), str(refused)
        assert isinstance(refused, ValueError) and isinstance(refused, AgentRunsError)
    else:
        raise AssertionError(f"not refused: {argument}")
    assert everything(observer) == before
    assert not repo.conn.info.transaction_status  # idle: no transaction left open


def assert_refused_before_sql(dsn: str, argument: str, call: Call) -> None:
    """On a closed connection any SQL would fail: only validation can answer `call`."""
    closed = connect(dsn)
    closed.close()
    fake = Runs(pending="pending-run", running="running-run", now=datetime.now(UTC))
    try:
        call(AgentRunRepository(closed), fake)
    except InvalidArgument as refused:
        assert argument in str(refused), str(refused)
    else:
        raise AssertionError(f"not refused: {argument}")


def register_waiter(connection: psycopg.Connection[Any], run_id: str) -> str:
    """Register interest in the run's end as wait_for_run does; returns the waiter id."""
    from agent_runs import waiters

    waiter_id = waiters.new_waiter_id()
    assert waiters.register(connection, run_id, waiter_id, 60.0)
    return waiter_id
