"""AgentRunRepository: every transition of a run and its attempts, one SQL file each."""

from __future__ import annotations

import contextlib
import re
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import UTC, datetime
from functools import cache, lru_cache
from typing import Any, Final, LiteralString

import psycopg
from psycopg import errors as pg_errors
from psycopg.pq import PipelineStatus, TransactionStatus
from psycopg.pq.abc import PGconn
from psycopg.types.json import Jsonb

from agent_runs import validation as check
from agent_runs.errors import (
    UQ_ONE_ACTIVE_PER_THREAD,
    UQ_ONE_OPEN_ATTEMPT,
    UQ_RUN_ATTEMPT_NO,
    InvalidArgument,
    NotLeaseOwner,
    ThreadBusy,
)
from agent_runs.models import AgentRun, Claim, RunAttempt, RunStatus, Transition
from agent_runs.sql import query

LEASE_EXPIRED_MESSAGE: Final = (
    "the worker's lease expired before it reported a result: the outcome is unknown. Under "
    "at-least-once semantics the agent may have run partly or fully; check its side effects "
    "before running it again."
)

# A claim computes attempt_no = max + 1 from its statement's snapshot. If another claimer
# committed a claim *and* a release between that snapshot and our lock, the database refuses
# the duplicate; a new statement (new snapshot) then sees it. Bounded: the race is rare.
_CLAIM_RACE_CONSTRAINTS: Final = frozenset({UQ_RUN_ATTEMPT_NO, UQ_ONE_OPEN_ATTEMPT})
_CLAIM_TRIES: Final = 5

_RUN_FIELDS: Final = tuple(f.name for f in fields(AgentRun))
_ATTEMPT_FIELDS: Final = tuple(f.name for f in fields(RunAttempt))
_TIMESTAMPS: Final = frozenset(
    {
        "heartbeat_at",
        "lease_expires_at",
        "manifest_recorded_at",
        "started_at",
        "finished_at",
        "created_at",
        "updated_at",
    }
)
# Positions of the timestamp fields among each model's fields (made timezone-aware UTC).
_RUN_TIMESTAMPS: Final = tuple(i for i, n in enumerate(_RUN_FIELDS) if n in _TIMESTAMPS)
_ATTEMPT_TIMESTAMPS: Final = tuple(i for i, n in enumerate(_ATTEMPT_FIELDS) if n in _TIMESTAMPS)


_PLACEHOLDER: Final = re.compile(r"%\((\w+)\)s")


@dataclass(frozen=True, slots=True)
class _Statement:
    """sql/<name>.sql as a server-side prepared statement, run in one protocol message."""

    name: LiteralString  # the prepared statement's name on the server
    prepare: LiteralString  # PREPARE <name> AS <the file's SQL, %(param)s -> $n>
    transaction: LiteralString  # BEGIN; EXECUTE <name>(%s, ...); COMMIT
    params: tuple[str, ...]  # parameter names, in $n order


@cache
def _statement(name: str) -> _Statement:
    text = query(name)
    params: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in params:
            params.append(match.group(1))
        return f"${params.index(match.group(1)) + 1}"

    body = _PLACEHOLDER.sub(number, text)
    server_name = f"agent_runs_{name}"
    args = ", ".join(["%s"] * len(params))
    # Derived only from the shipped .sql file and its fixed name: literal SQL, never input.
    return _Statement(
        name=server_name,
        prepare=f"PREPARE {server_name} AS\n{body}",
        transaction=f"BEGIN; EXECUTE {server_name}({args}); COMMIT",
        params=tuple(params),
    )


@dataclass(frozen=True, slots=True)
class _Shape:
    """Where each column of a result is, and where the model fields are among them."""

    index: Mapping[str, int]
    run: tuple[int, ...] | None  # positions of AgentRun's fields, if the row carries a run
    attempt: tuple[int, ...] | None  # positions of RunAttempt's fields, likewise


@lru_cache(maxsize=128)
def _shape(names: tuple[str, ...]) -> _Shape:
    index: dict[str, int] = {}
    for position, name in enumerate(names):
        index.setdefault(name, position)

    def positions(wanted: tuple[str, ...]) -> tuple[int, ...] | None:
        return tuple(index[n] for n in wanted) if all(n in index for n in wanted) else None

    return _Shape(index=index, run=positions(_RUN_FIELDS), attempt=positions(_ATTEMPT_FIELDS))


def _shape_of(cur: psycopg.Cursor[Any]) -> _Shape:
    return _shape(tuple(column.name for column in cur.description or ()))


class _Record:
    """One result row: its values as a tuple, read by column name through the result's shape."""

    __slots__ = ("shape", "values")

    def __init__(self, shape: _Shape, values: Sequence[Any]) -> None:
        self.shape = shape
        self.values = values

    def __getitem__(self, name: str) -> Any:
        return self.values[self.shape.index[name]]


def _records(shape: _Shape, rows: list[tuple[Any, ...]]) -> list[_Record]:
    return [_Record(shape, row) for row in rows]


@dataclass(slots=True)
class _Session:
    """One server session's prepared statements, and their result shapes once seen.

    A prepared statement's result shape cannot change within its session (PostgreSQL refuses:
    "cached plan must not change result type"), so a shape seen once stays right.
    """

    shapes: dict[str, _Shape | None] = field(default_factory=dict)


# Keyed by the PGconn, which lives exactly as long as its server session. The values hold no
# reference back to the connection, so a closed connection's entry goes away with it.
_sessions: weakref.WeakKeyDictionary[PGconn, _Session] = weakref.WeakKeyDictionary()


def _utc_values(record: _Record, positions: tuple[int, ...], stamps: tuple[int, ...]) -> list[Any]:
    values = record.values
    fields_ = [values[i] for i in positions]
    for i in stamps:
        value = fields_[i]
        if value is not None and value.tzinfo is not UTC:
            fields_[i] = value.astimezone(UTC)
    return fields_


def _run(record: _Record) -> AgentRun:
    positions = record.shape.run
    if positions is None:  # pragma: no cover - every run statement returns the run's columns
        raise AssertionError("this result carries no run")
    return AgentRun(*_utc_values(record, positions, _RUN_TIMESTAMPS))


def _attempt(record: _Record) -> RunAttempt:
    positions = record.shape.attempt
    if positions is None:  # pragma: no cover - every attempt statement returns its columns
        raise AssertionError("this result carries no attempt")
    return RunAttempt(*_utc_values(record, positions, _ATTEMPT_TIMESTAMPS))


class AgentRunRepository:
    """The data access object for agent_runs and agent_run_attempts over one psycopg connection.

    Every method runs in its own explicit transaction, which becomes a savepoint inside a
    transaction the caller already has open. Each transition locks the run row first and
    changes the run and its attempt in that one transaction (one statement, one round trip).
    """

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        # One client-side cursor per thread: reused, it keeps its adapters cached.
        self._local = threading.local()

    # -- plumbing --------------------------------------------------------------------------

    def _execute(self, name: LiteralString, params: Mapping[str, Any]) -> list[_Record]:
        """Run sql/<name>.sql in an explicit transaction and return its rows."""
        conn = self.conn
        pgconn = conn.pgconn
        if (
            pgconn.transaction_status == TransactionStatus.IDLE
            and pgconn.pipeline_status == PipelineStatus.OFF
            and conn.autocommit
        ):
            stmt = _statement(name)
            try:
                return self._execute_in_one_message(stmt, params)
            except pg_errors.InvalidSqlStatementName:
                # The session lost the prepared statement (DISCARD ALL, or a pooler that moved
                # us to another server session): run this call the classic way, prepare again
                # on the next one.
                session = _sessions.get(pgconn)
                if session is not None:
                    session.shapes.pop(stmt.name, None)
        # Inside the caller's transaction this is a savepoint around the statement.
        with conn.transaction():
            cur = conn.cursor()
            cur.execute(query(name), params, prepare=True)
            return _records(_shape_of(cur), cur.fetchall())

    def _execute_in_one_message(self, stmt: _Statement, params: Mapping[str, Any]) -> list[_Record]:
        """BEGIN; EXECUTE <prepared statement>; COMMIT, sent as one simple-protocol message.

        One round trip and one packet each way (psycopg's pipeline mode sends BEGIN, the
        statement, COMMIT, Sync and Flush as separate writes). The statement is prepared once
        per server session; its arguments are quoted by psycopg's client-side binding
        (ClientCursor), so values stay data. Rows come back as tuples, read by column name
        through the statement's result shape (computed once per session).
        """
        conn = self.conn
        session = _sessions.get(conn.pgconn)
        if session is None:
            session = _sessions.setdefault(conn.pgconn, _Session())
        shapes = session.shapes
        if stmt.name not in shapes:
            # Another thread sharing this connection may have prepared it first.
            with contextlib.suppress(pg_errors.DuplicatePreparedStatement):
                conn.execute(stmt.prepare)
            shapes.setdefault(stmt.name, None)
        cur: psycopg.ClientCursor[tuple[Any, ...]] | None = getattr(self._local, "cursor", None)
        if cur is None or cur.connection is not conn or cur.closed:
            cur = self._local.cursor = psycopg.ClientCursor(conn)
        try:
            cur.execute(stmt.transaction, [params[name] for name in stmt.params])
        except BaseException:
            self._rollback_failed()
            raise
        cur.nextset()  # from BEGIN's result to the statement's
        shape = shapes.get(stmt.name)
        if shape is None:
            shape = shapes[stmt.name] = _shape_of(cur)
        return _records(shape, cur.fetchall())

    def _rollback_failed(self) -> None:
        """End the transaction a failed one-message transition left open (its COMMIT never ran)."""
        conn = self.conn
        if not conn.closed and conn.pgconn.transaction_status != TransactionStatus.IDLE:
            # Leave the connection idle again; the original error is the one to report.
            with contextlib.suppress(psycopg.Error):
                conn.execute("ROLLBACK")

    def _claim(self, name: LiteralString, params: Mapping[str, Any]) -> list[_Record]:
        for tries_left in range(_CLAIM_TRIES - 1, -1, -1):
            try:
                return self._execute(name, params)
            except pg_errors.UniqueViolation as exc:
                if exc.diag.constraint_name not in _CLAIM_RACE_CONSTRAINTS or not tries_left:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    # -- creating and reading -----------------------------------------------------------

    def create_run(
        self,
        *,
        thread_id: str,
        agent_slug: str,
        uid: str,
        request_id: str,
        input_payload: Mapping[str, Any] | None = None,
        run_type: str = "chat",
        created_by_run_id: str | None = None,
        run_id: str | None = None,
    ) -> AgentRun:
        """Create a pending run; the same request_id again returns the existing run.

        Raises ThreadBusy when another non-terminal run exists on (uid, agent_slug, thread_id).
        """
        params = {
            "thread_id": check.identifier("thread_id", thread_id),
            "agent_slug": check.identifier("agent_slug", agent_slug),
            "uid": check.identifier("uid", uid),
            "request_id": check.identifier("request_id", request_id),
            "input_payload": Jsonb(
                check.json_object("input_payload", {} if input_payload is None else input_payload)
            ),
            "run_type": check.run_type(run_type),
            "created_by_run_id": check.optional_identifier("created_by_run_id", created_by_run_id),
            "run_id": str(uuid.uuid4()) if run_id is None else check.identifier("run_id", run_id),
        }
        try:
            with self.conn.transaction():
                cur = self.conn.cursor()
                row = cur.execute(query("create_run"), params).fetchone()
                if row is None:  # request_id seen before: a new statement sees its run
                    row = cur.execute(query("get_run_by_request_id"), params).fetchone()
                if row is None:  # pragma: no cover - the other run was deleted in between
                    raise InvalidArgument(f"request_id {request_id!r} is being reused; retry")
                return _run(_Record(_shape_of(cur), row))
        except pg_errors.UniqueViolation as exc:
            # A concurrent create with the same request_id can trip the thread index before
            # ON CONFLICT sees the request_id: idempotency is checked first, so look again.
            existing = self._execute("get_run_by_request_id", params)
            if existing:
                return _run(existing[0])
            if exc.diag.constraint_name == UQ_ONE_ACTIVE_PER_THREAD:
                raise ThreadBusy(
                    f"thread {thread_id!r} of uid {uid!r} already has an active run of agent "
                    f"{agent_slug!r}"
                ) from None
            if exc.diag.constraint_name == "agent_runs_pkey":
                raise InvalidArgument(f"run_id {run_id!r} already exists") from None
            raise
        except pg_errors.ForeignKeyViolation:
            raise InvalidArgument(
                f"created_by_run_id {created_by_run_id!r} is not an existing run"
            ) from None

    def get_run(self, run_id: str) -> AgentRun | None:
        rows = self._execute("get_run", {"run_id": check.identifier("run_id", run_id)})
        return _run(rows[0]) if rows else None

    def get_run_by_owner(self, worker_id: str) -> AgentRun | None:
        """The live run whose lease this owner token holds, if any (e.g. after a lost reply)."""
        rows = self._execute("get_run_by_owner", {"worker_id": check.worker_id(worker_id)})
        return _run(rows[0]) if rows else None

    def list_run_attempts(self, run_id: str) -> list[RunAttempt]:
        rows = self._execute("list_run_attempts", {"run_id": check.identifier("run_id", run_id)})
        return [_attempt(row) for row in rows]

    def get_open_attempt(self, run_id: str) -> RunAttempt | None:
        rows = self._execute("get_open_attempt", {"run_id": check.identifier("run_id", run_id)})
        return _attempt(rows[0]) if rows else None

    # -- ownership -----------------------------------------------------------------------

    def mark_running(
        self,
        run_id: str,
        *,
        worker_id: str,
        lease_seconds: float,
        now: datetime | None = None,
    ) -> Claim:
        """Claim a run (initial claim) or refresh the lease of its same live owner."""
        rows = self._claim(
            "mark_running",
            {
                "run_id": check.identifier("run_id", run_id),
                "worker_id": check.worker_id(worker_id),
                "lease_seconds": check.lease_seconds(lease_seconds),
                "now": check.now(now),
                "lost_message": LEASE_EXPIRED_MESSAGE,
            },
        )
        if not rows:
            return Claim(None, False)
        return Claim(_run(rows[0]), bool(rows[0]["acquired"]))

    def claim_next(
        self,
        *,
        worker_id: str,
        lease_seconds: float,
        now: datetime | None = None,
        agent_slugs: list[str] | None = None,
    ) -> AgentRun | None:
        """Claim the oldest claimable run (FIFO by created_at, id), or None when there is none."""
        rows = self._claim(
            "claim_next",
            {
                "worker_id": check.worker_id(worker_id),
                "lease_seconds": check.lease_seconds(lease_seconds),
                "now": check.now(now),
                "agent_slugs": check.agent_slugs(agent_slugs),
                "lost_message": LEASE_EXPIRED_MESSAGE,
            },
        )
        return _run(rows[0]) if rows else None

    def renew_lease(
        self,
        run_id: str,
        *,
        worker_id: str,
        lease_seconds: float,
        now: datetime | None = None,
    ) -> bool:
        """Extend the live lease of its owner (run and open attempt); False when not the owner."""
        rows = self._execute(
            "renew_lease",
            {
                "run_id": check.identifier("run_id", run_id),
                "worker_id": check.worker_id(worker_id),
                "lease_seconds": check.lease_seconds(lease_seconds),
                "now": check.now(now),
            },
        )
        return bool(rows)

    def renew_leases(
        self,
        leases: Mapping[str, str],
        *,
        lease_seconds: float,
        now: datetime | None = None,
    ) -> dict[str, RunStatus]:
        """renew_lease for many run_id -> worker_id leases in one statement.

        Returns the renewed runs with their current status (a cancel request shows as
        cancel_requested); refused leases are absent.
        """
        run_ids, worker_ids = check.leases(leases)
        params = {
            "run_ids": run_ids,
            "worker_ids": worker_ids,
            "lease_seconds": check.lease_seconds(lease_seconds),
            "now": check.now(now),
        }
        if not run_ids:
            return {}
        rows = self._execute("renew_leases", params)
        return {row["id"]: RunStatus(row["status"]) for row in rows}

    def release_lease_for_retry(
        self, run_id: str, *, worker_id: str, now: datetime | None = None
    ) -> bool:
        """Give a running run back to the queue (pending); the attempt ends retry_released."""
        rows = self._execute(
            "release_lease_for_retry",
            {
                "run_id": check.identifier("run_id", run_id),
                "worker_id": check.worker_id(worker_id),
                "now": check.now(now),
            },
        )
        return bool(rows)

    # -- finishing -----------------------------------------------------------------------

    def set_terminal_status(
        self,
        run_id: str,
        *,
        status: RunStatus | str,
        worker_id: str | None = None,
        error_type: str | None = None,
        error_message: str | None = None,
        now: datetime | None = None,
    ) -> Transition:
        """Finish a run (and its owner's attempt) when the transition rules allow it."""
        rows = self._execute(
            "set_terminal_status",
            {
                "run_id": check.identifier("run_id", run_id),
                "status": check.terminal_status(status).value,
                "worker_id": check.optional_worker_id(worker_id),
                "error_type": check.error_type(error_type),
                "error_message": check.error_message(error_message),
                "now": check.now(now),
            },
        )
        if not rows:
            return Transition(None, False)
        return Transition(_run(rows[0]), bool(rows[0]["changed"]))

    def request_cancel(self, run_id: str, *, now: datetime | None = None) -> AgentRun | None:
        """Cancel a run that never started; ask the owner of any other live run to cancel."""
        rows = self._execute(
            "request_cancel",
            {"run_id": check.identifier("run_id", run_id), "now": check.now(now)},
        )
        return _run(rows[0]) if rows else None

    def reconcile_expired_leases(
        self, *, now: datetime | None = None, limit: int = 500
    ) -> list[AgentRun]:
        """Fail every run that lost its owner (at most `limit`); returns them as converged."""
        params = {
            "now": check.now(now),
            "limit": check.limit(limit),
            "lost_message": LEASE_EXPIRED_MESSAGE,
        }
        with self.conn.transaction():
            cur = self.conn.cursor()
            locked = cur.execute(query("lock_expired_leases"), params).fetchall()
            if not locked:
                return []
            run_ids = [run_id for (run_id,) in locked]
            cur.execute(query("reconcile_expired_leases"), {**params, "run_ids": run_ids})
            return [_run(record) for record in _records(_shape_of(cur), cur.fetchall())]

    def record_run_manifest(
        self,
        run_id: str,
        *,
        manifest: Mapping[str, Any],
        fingerprint: str,
        worker_id: str,
        now: datetime | None = None,
    ) -> Transition:
        """Record the run manifest once, by the live owner of the running run."""
        rows = self._execute(
            "record_run_manifest",
            {
                "run_id": check.identifier("run_id", run_id),
                "manifest": Jsonb(check.json_object("manifest", manifest)),
                "fingerprint": check.fingerprint(fingerprint),
                "worker_id": check.worker_id(worker_id),
                "now": check.now(now),
            },
        )
        if not rows:
            return Transition(None, False)
        row = rows[0]
        if not row["is_owner"]:
            raise NotLeaseOwner(
                f"{worker_id!r} is not the lease owner of running run {run_id!r} "
                "(only the owner of a running run with a live lease may record its manifest)"
            )
        return Transition(_run(row), bool(row["changed"]))
