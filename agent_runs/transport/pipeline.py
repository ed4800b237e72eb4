"""One transition in one round trip: BEGIN, its prepared statement and COMMIT as one libpq
pipeline, with the bookkeeping of what each server session has prepared."""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Final

import psycopg
from psycopg import adapt, pq
from psycopg import errors as pg_errors
from psycopg.abc import Transformer
from psycopg.adapt import PyFormat
from psycopg.pq.abc import PGconn, PGresult

from agent_runs.transport.connection import abandon, exchange, rollback
from agent_runs.transport.results import Row, Shape, shape
from agent_runs.transport.statements import Statement, statement_name

_OK: Final = pq.ExecStatus.COMMAND_OK
_FATAL_ERROR: Final = pq.ExecStatus.FATAL_ERROR
_IDLE: Final = pq.TransactionStatus.IDLE
_PIPELINE_OFF: Final = pq.PipelineStatus.OFF
_BINARY: Final = pq.Format.BINARY

PIPELINE_SUPPORTED: Final = psycopg.Pipeline.is_supported()


@dataclass(slots=True)
class _Session:
    """What one connection's server session has prepared, as far as this process knows.

    Behind a transaction pooler the server session changes under the connection, so what it
    holds can surprise us: a statement we prepared is missing, or one we did not prepare is
    there. One surprise is a reset (DISCARD ALL): the statements are prepared again. A second
    one means a pooler: the connection stops using named statements for good.
    """

    prepared: set[bytes] = field(default_factory=set)  # statement names
    # Each statement's result columns: (their count, their shape), re-read when the count moves.
    shapes: dict[str, tuple[int, Shape]] = field(default_factory=dict)
    surprises: int = 0
    unnamed: bool = False


# Keyed by the PGconn, which lives exactly as long as its connection. The values hold no
# reference back to the connection, so a closed connection's entry goes away with it.
_sessions: weakref.WeakKeyDictionary[PGconn, _Session] = weakref.WeakKeyDictionary()

_SURPRISES_BEFORE_UNNAMED: Final = 2
# Tries of one call: surprises rerun the rolled-back transaction; after the second surprise the
# statements are unnamed and cannot surprise again.
_TRIES: Final = _SURPRISES_BEFORE_UNNAMED + 2


def _session(pgconn: PGconn) -> _Session:
    session = _sessions.get(pgconn)
    if session is None:
        session = _sessions.setdefault(pgconn, _Session())
    return session


@dataclass(frozen=True, slots=True)
class _Prepared:
    """A statement as the pipeline sends it: its name and text as bytes, made once."""

    name: bytes
    sql: bytes


def _named(sql: bytes) -> _Prepared:
    return _Prepared(statement_name(sql.decode().lower(), sql.decode()).encode(), sql)


# The transaction's own statements, prepared once per session like the transitions, so that
# BEGIN and COMMIT cost the server no parsing either.
BEGIN: Final = _named(b"BEGIN")
COMMIT: Final = _named(b"COMMIT")


@cache
def _prepared(stmt: Statement) -> _Prepared:
    return _Prepared(stmt.name.encode(), stmt.sql.encode())


class _UtcContext:
    """The connection's adapters, loading timestamptz as UTC whatever the session's TimeZone.

    psycopg's loaders take the time zone (and the text encoding) from the context's connection.
    Binary timestamptz is UTC on the wire, so a context without a connection loads it as UTC
    directly, and the models have no conversion left to do. The encoding psycopg assumes
    without a connection is UTF-8: Channel only runs on connections whose client encoding it is.
    """

    __slots__ = ("adapters", "connection")

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.adapters = conn.adapters
        self.connection = None


class _Rerun:
    """A transaction rolled back because of what the session had prepared: run it again."""


_RERUN: Final = _Rerun()


class Channel:
    """One thread's way to run transitions over one connection, one round trip each.

    Holds the thread's psycopg Transformer (its adapters stay cached; a Transformer is not
    thread-safe) and the connection's server session. Threads sharing a connection take turns
    on its lock, as psycopg's own cursors do.
    """

    __slots__ = ("conn", "pgconn", "session", "tx")

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.pgconn = conn.pgconn
        self.session = _session(self.pgconn)
        self.tx: Transformer = adapt.Transformer(_UtcContext(conn))

    def named(self) -> bool:
        """Whether transitions use named prepared statements on this connection now."""
        return self.conn.prepare_threshold is not None and not self.session.unnamed

    def _free(self) -> bool:
        """Whether a transition may open its own transaction here now: an autocommit connection
        that is idle (no transaction of the caller's open), outside the caller's own pipeline,
        speaking UTF-8 (see _UtcContext). The caller holds the connection's lock."""
        pgconn = self.pgconn
        return (
            PIPELINE_SUPPORTED
            and pgconn.transaction_status == _IDLE
            and pgconn.pipeline_status == _PIPELINE_OFF
            and self.conn.autocommit
            and pgconn.parameter_status(b"client_encoding") == b"UTF8"
        )

    def execute(self, stmt: Statement, args: Sequence[Any]) -> list[Row] | None:
        """BEGIN; EXECUTE stmt(args); COMMIT in one round trip: the statement's rows, or None
        when the connection is not free for a transaction of its own (run it the classic way).

        A server error (psycopg's exception class for its SQLSTATE) is raised after the
        transaction has been rolled back. If the session's prepared statements were not what
        this process thought (DISCARD ALL, a pooler's other server session), nothing was
        written: it learns what they are and runs the transaction again.
        """
        for _ in range(_TRIES):
            outcome = self._attempt(stmt, args)
            if isinstance(outcome, psycopg.Error):
                raise outcome
            if not isinstance(outcome, _Rerun):
                return outcome
        return None  # pragma: no cover - unnamed statements never ask for a rerun

    def _attempt(
        self, stmt: Statement, args: Sequence[Any]
    ) -> list[Row] | psycopg.Error | _Rerun | None:
        conn, pgconn, session = self.conn, self.pgconn, self.session
        main = _prepared(stmt)
        values = self.tx.dump_sequence(args, [PyFormat.TEXT] * len(args))
        unprepared: list[_Prepared] = []
        with conn.lock:
            if not self._free():
                return None
            named = self.named()
            synced = False
            pgconn.enter_pipeline_mode()
            try:
                if named:
                    prepared = session.prepared
                    unprepared = [s for s in (BEGIN, main, COMMIT) if s.name not in prepared]
                    for missing in unprepared:
                        pgconn.send_prepare(missing.name, missing.sql)
                    pgconn.send_query_prepared(BEGIN.name, None)
                    pgconn.send_query_prepared(main.name, values, result_format=_BINARY)
                    pgconn.send_query_prepared(COMMIT.name, None)
                else:  # unnamed statements: parsed each time, in the same single round trip
                    pgconn.send_query_params(BEGIN.sql, None)
                    pgconn.send_query_params(main.sql, values, result_format=_BINARY)
                    pgconn.send_query_params(COMMIT.sql, None)
                pgconn.pipeline_sync()
                synced = True
                results = exchange(pgconn)
            except BaseException:
                abandon(pgconn, synced=synced)
                raise
            pgconn.exit_pipeline_mode()
            if pgconn.transaction_status != _IDLE:  # the statement failed inside BEGIN … COMMIT
                rollback(pgconn, deadline=None)
        made = [
            missing.name
            for missing, parsed in zip(unprepared, results, strict=False)
            if parsed.status == _OK or _sqlstate(parsed) == _DUPLICATE_STATEMENT
        ]  # prepared now, or there already
        session.prepared.update(made)
        # After an error, every later command of the pipeline comes back PIPELINE_ABORTED.
        failed = next((r for r in results if r.status == _FATAL_ERROR), None)
        if failed is not None:
            state = _sqlstate(failed)
            if named and state in _SURPRISES:
                self._surprised(state, made)
                return _RERUN
            return pg_errors.error_from_result(failed, encoding=conn.info.encoding)
        result = results[-2]
        nfields = result.nfields
        known = session.shapes.get(stmt.name)
        if known is None or known[0] != nfields:
            names = tuple((result.fname(i) or b"").decode() for i in range(nfields))
            known = session.shapes[stmt.name] = (nfields, shape(names))
        found = known[1]
        tx = self.tx
        tx.set_pgresult(result)
        return [Row(found, values) for values in tx.load_rows(0, result.ntuples, tuple)]

    def _surprised(self, state: bytes | None, made: list[bytes]) -> None:
        """The session's prepared statements were not what we thought: learn, or stop naming.
        `made`: the statements the failed pipeline itself prepared (they are there now)."""
        session = self.session
        if state == _UNKNOWN_STATEMENT:
            # DISCARD ALL, or another server session behind a pooler: only these are known.
            session.prepared = set(made)
        session.surprises += 1
        if state == _PLAN_CHANGED or session.surprises >= _SURPRISES_BEFORE_UNNAMED:
            session.unnamed = True
            # psycopg's own statement names (_pg3_0, …) would meet other clients' statements in
            # the pooler's server sessions too: stop them on this connection as well.
            self.conn.prepare_threshold = None


_UNKNOWN_STATEMENT: Final = b"26000"  # invalid_sql_statement_name
_DUPLICATE_STATEMENT: Final = b"42P05"  # duplicate_prepared_statement
# A prepared statement whose result columns changed under it (a migration since it was made).
_PLAN_CHANGED: Final = b"0A000"  # feature_not_supported: "cached plan must not change result type"
_SURPRISES: Final = frozenset({_UNKNOWN_STATEMENT, _DUPLICATE_STATEMENT, _PLAN_CHANGED})


def _sqlstate(result: PGresult) -> bytes | None:
    return result.error_field(pq.DiagnosticField.SQLSTATE)
