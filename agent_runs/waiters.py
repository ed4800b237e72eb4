"""Waiting for a run's end, written once for both faces: the registration of interest, and the
wait itself as a plan (the pattern of agent_runs.steps) that agent_runs.notify carries out on a
connection and agent_runs.aio.notify awaits on an AsyncConnection.

Registrations: a terminal transition sends agent_runs_finished only for a run that has one
(migrations/0011_run_waiters.sql explains the race it closes). A wait registers before its
LISTEN and its first read of the run, and unregisters when it returns; the run's end takes the
registrations it notified. A waiter that is killed leaves its row until the run ends or the
row's expiry passes (then the next waiter that unregisters deletes it).

The wait listens on a connection of its own, opened as the caller's was and closed, never
cleaned, when the wait ends or is flooded: a connection that LISTENs has every notification
the server already queued for it ahead of the answer to its next statement, so an UNLISTEN or
any other statement on it could take as long as the others' notifications take to read. The
caller's connection never listens: its reads and its unregistration queue behind nothing.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, LiteralString, TypeAlias

import psycopg
from psycopg import errors as pg_errors
from psycopg.conninfo import make_conninfo
from psycopg.rows import tuple_row

from agent_runs import validation as check
from agent_runs.errors import InvalidArgument
from agent_runs.models import AgentRun
from agent_runs.sql import query

FINISHED_CHANNEL: Final = "agent_runs_finished"
LISTEN: Final = "LISTEN agent_runs_finished"
NOT_IDLE: Final = "conn must be an idle autocommit connection (the registration commits at once)"

# A wait re-reads the run this often in case a notification was missed (a pooler between the
# listener and the server, a listener that could not connect).
WAIT_POLL_SECONDS: Final = 2.0
# A wait reads at most this many other runs' notifications in one slice; past it the listener
# is flooded (reading them would cost the waiter a core), so it is closed and the wait re-reads
# the run every FLOODED_POLL_SECONDS instead.
FLOOD_NOTIFICATIONS: Final = 10_000
FLOODED_POLL_SECONDS: Final = 0.2
# The listener's connection: a server that does not answer in this long is polled instead.
LISTENER_CONNECT_TIMEOUT: Final = 2
# A dead peer (no FIN) is noticed by TCP keepalives: a listener only ever reads.
KEEPALIVES: Final[Mapping[str, int]] = {
    "keepalives": 1,
    "keepalives_idle": 15,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}
LISTENER_OPTIONS: Final[Mapping[str, Any]] = {
    "autocommit": True,
    "connect_timeout": LISTENER_CONNECT_TIMEOUT,
    **KEEPALIVES,
}

# A registration outlives its waiter's timeout by this much before others may delete it.
EXPIRY_MARGIN_SECONDS: Final = 60.0
# Longer waits keep a registration this long (their poll still sees the run end after it).
MAX_EXPIRY_SECONDS: Final = 30 * 86400.0
LOCK_TIMEOUT: Final = "SELECT set_config('lock_timeout', %s, true)"
# The largest lock_timeout PostgreSQL accepts (an int of milliseconds, about 24.8 days).
MAX_LOCK_TIMEOUT_MS: Final = 2**31 - 1


# -- the steps of a wait: what a face carries out and sends back ------------------------------


@dataclass(frozen=True, slots=True)
class Register:
    """Take the connection's turn (within `timeout` seconds), check it is idle and autocommit
    (else InvalidArgument), register: send back `register`'s answer."""

    run_id: str
    waiter_id: str
    timeout: float


@dataclass(frozen=True, slots=True)
class Listen:
    """Open the listener (`listener_conninfo`, LISTEN_OPTIONS) and LISTEN on it: send back
    True, or False when it could not (the wait then polls)."""


@dataclass(frozen=True, slots=True)
class Read:
    """Read the run on the caller's connection: send back an AgentRun, or None."""

    run_id: str


@dataclass(frozen=True, slots=True)
class Hear:
    """Read the listener's notifications through a `Hearing` until it decides: send back its
    verdict (QUIET when none came by `until`, a monotonic time; LOST on a database error)."""

    run_id: str
    until: float


@dataclass(frozen=True, slots=True)
class Sleep:
    """Sleep until `until` (a monotonic time)."""

    until: float


@dataclass(frozen=True, slots=True)
class StopListening:
    """Close the listener if one is open, without reading what it was sent."""


@dataclass(frozen=True, slots=True)
class Unregister:
    """Take the connection's turn and, on an idle connection, run `unregister_statement`
    (the asyncio face closes one a cancellation left anywhere else)."""

    run_id: str
    waiter_id: str


WaitStep: TypeAlias = Register | Listen | Read | Hear | Sleep | StopListening | Unregister
WaitPlan: TypeAlias = Generator[WaitStep, Any, AgentRun]

# What a listening slice heard: the run's end, a flood of others' notifications, neither, or
# that the listener's connection failed (the wait polls on without it).
SEEN: Final = "seen"
FLOODED: Final = "flooded"
QUIET: Final = "quiet"
LOST: Final = "lost"


def wait_plan(run_id: str, timeout_seconds: float, *, poll_seconds: float) -> WaitPlan:
    """wait_for_run's rules: yields the steps above, receives their answers (or their errors
    thrown in), returns the terminal run. Raises InvalidArgument for bad arguments or an
    unknown run, TimeoutError when the run is not terminal after `timeout_seconds`."""
    run_id = check.identifier("run_id", run_id)
    timeout = check.timeout_seconds(timeout_seconds)
    deadline = time.monotonic() + timeout
    waiter_id = new_waiter_id()
    # Register, then LISTEN, before the first read: a run that ends after the read is then
    # always notified (its end notifies only registered runs), one that ended before LISTEN is
    # terminal in the read. Nothing registered: the run is missing or ended, the read says so.
    registered: bool = yield Register(run_id, waiter_id, timeout)
    listening = False
    try:
        if registered and time.monotonic() < deadline:
            listening = yield Listen()
        pause = poll_seconds  # between reads while not listening
        run: AgentRun | None = yield Read(run_id)
        if run is None:
            raise InvalidArgument(f"run_id {run_id!r}: no such run")
        while not run.is_terminal:
            now = time.monotonic()
            if now >= deadline:
                raise _still(run, timeout)
            heard = QUIET
            if listening:
                heard = yield Hear(run_id, min(deadline, now + poll_seconds))
                if heard in (FLOODED, LOST):
                    listening = False
                    yield StopListening()
                    pause = FLOODED_POLL_SECONDS if heard == FLOODED else poll_seconds
            else:
                yield Sleep(min(deadline, now + pause))
            if heard != SEEN and time.monotonic() >= deadline:
                # Its end was not heard by the deadline: no further read delays the answer.
                raise _still(run, timeout)
            run = yield Read(run_id)
            if run is None:
                raise InvalidArgument(f"run_id {run_id!r}: the run was deleted while waiting")
        return run
    finally:
        if registered:
            yield StopListening()  # (if one is open: a Listen interrupted may have left one)
            yield Unregister(run_id, waiter_id)


def _still(run: AgentRun, timeout: float) -> TimeoutError:
    return TimeoutError(f"run {run.id!r} is still {run.status} after {timeout:g} seconds")


class Hearing:
    """One `Hear` step: the verdict on each notification the listener reads, the clock checked
    after every one (psycopg's own timeout is checked only between batches), so others'
    notifications never keep the waiter past `until`."""

    __slots__ = ("others", "run_id", "until")

    def __init__(self, step: Hear) -> None:
        self.run_id = step.run_id
        self.until = step.until
        self.others = 0

    def remaining(self) -> float:
        return max(0.0, self.until - time.monotonic())

    def verdict(self, channel: str, payload: str) -> str | None:
        """SEEN, FLOODED or QUIET once decided; None: read on."""
        if channel == FINISHED_CHANNEL and payload == self.run_id:
            return SEEN
        self.others += 1
        if self.others > FLOOD_NOTIFICATIONS:
            return FLOODED
        if time.monotonic() >= self.until:
            return QUIET
        return None


def listener_conninfo(info: psycopg.ConnectionInfo) -> str:
    """A connection string for the listener: the parameters the caller's connection was opened
    with, its password included (psycopg's `dsn` omits it), and the server, database and user
    it reached named outright (psycopg leaves out a value equal to libpq's built-in default,
    which the environment could then override)."""
    params: dict[str, str | int] = {
        **info.get_parameters(),
        "host": info.host,
        "port": info.port,
        "dbname": info.dbname,
        "user": info.user,
    }
    if info.password:
        params["password"] = info.password
    return make_conninfo("", **params)


# -- registrations ------------------------------------------------------------------------


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
