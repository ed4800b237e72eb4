"""Registrations of interest in a run's end: a terminal transition sends agent_runs_finished
only for a run that has one (migrations/0011_run_waiters.sql explains the race it closes).

wait_for_run registers before its LISTEN and its first read of the run, and unregisters when
it returns; the run's end takes the registrations it notified. A waiter that is killed
leaves its row until the run ends or the row's expiry passes (then the next waiter that
unregisters deletes it).
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Sequence
from typing import Any, Final, LiteralString

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import tuple_row

from agent_runs.sql import query

# A registration outlives its waiter's timeout by this much before others may delete it.
EXPIRY_MARGIN_SECONDS: Final = 60.0
# Longer waits keep a registration this long (their poll still sees the run end after it).
MAX_EXPIRY_SECONDS: Final = 30 * 86400.0
LOCK_TIMEOUT: Final = "SELECT set_config('lock_timeout', %s, true)"
# The largest lock_timeout PostgreSQL accepts (an int of milliseconds, about 24.8 days).
MAX_LOCK_TIMEOUT_MS: Final = 2**31 - 1


def new_waiter_id() -> str:
    return uuid.uuid4().hex


def register(
    conn: psycopg.Connection[Any], run_id: str, waiter_id: str, timeout_seconds: float
) -> bool:
    """Register `waiter_id`'s interest in run `run_id` (committed when this returns, on an
    idle autocommit connection). True when a registration was written: the run exists and was
    not terminal; a run that ended meanwhile is terminal in any read made after this returns.

    The registration waits for a transaction holding the run row (a finisher's is short), at
    most `timeout_seconds`: then TimeoutError, and nothing is registered.
    """
    lock_wait, sql, params = register_statement(run_id, waiter_id, timeout_seconds)
    try:
        # A cursor of our own row factory: the connection's may be any (dict_row, a class...).
        with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
            cur.execute(LOCK_TIMEOUT, [lock_wait], prepare=False)
            row = cur.execute(sql, params, prepare=False).fetchone()
    except pg_errors.LockNotAvailable:
        raise locked_too_long(run_id, timeout_seconds) from None
    return registered(row)


def register_statement(
    run_id: str, waiter_id: str, timeout_seconds: float
) -> tuple[str, LiteralString, dict[str, Any]]:
    """The registration's lock_timeout, SQL and parameters (for either kind of connection)."""
    seconds = min(timeout_seconds, MAX_EXPIRY_SECONDS) + EXPIRY_MARGIN_SECONDS
    # lock_timeout 0 would mean "wait forever": at least one millisecond; at most what the
    # setting takes (a wait that long for a finisher's lock is no different in practice).
    millis = math.ceil(min(timeout_seconds, MAX_EXPIRY_SECONDS) * 1000)
    lock_wait = f"{min(max(1, millis), MAX_LOCK_TIMEOUT_MS)}ms"
    params = {"run_id": run_id, "waiter_id": waiter_id, "expires_in_seconds": seconds}
    return lock_wait, query("wait_for_run.register"), params


def registered(row: Sequence[Any] | None) -> bool:
    """Whether the registration's answer says a registration was written."""
    return bool(row is not None and row[1])


def locked_too_long(run_id: str, timeout_seconds: float) -> TimeoutError:
    return TimeoutError(
        f"run {run_id!r} stayed locked by another transaction for {timeout_seconds:g} seconds"
    )


def unregister_statement(run_id: str, waiter_id: str) -> tuple[LiteralString, dict[str, Any]]:
    """The unregistration's SQL and parameters (for either kind of connection)."""
    return query("wait_for_run.unregister"), {"run_id": run_id, "waiter_id": waiter_id}


def unregister(conn: psycopg.Connection[Any], run_id: str, waiter_id: str) -> None:
    """Remove the registration (if the run's end did not take it) and some expired ones."""
    sql, params = unregister_statement(run_id, waiter_id)
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(sql, params, prepare=False)
