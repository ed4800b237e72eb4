"""How a transition reaches PostgreSQL: its own explicit transaction, in one round trip.

`BEGIN`, the transition's prepared statement and `COMMIT` go out as one libpq pipeline (one
write), and their results come back together (one read): an explicit transaction that costs
the network and the server no more than an autocommit statement. The statement is prepared on
the server once per session, in the same pipeline as its first use. Its parameters travel as
text, typed by the prepared statement itself; its rows come back in binary (no timestamp or
JSON text to format on the server and parse here).

Where that path does not apply (inside the caller's transaction, in the caller's own pipeline,
on a libpq without pipeline mode), the repository runs the same SQL the classic way.

Longer than most modules on purpose: everything that touches psycopg below its connection API
(libpq pipeline, socket waiting, result loading, prepared-statement bookkeeping) lives here and
nowhere else.

Without named statements (`conn.prepare_threshold is None`, psycopg's convention, or once a
connection pooler has been detected on the connection) the same pipeline carries unnamed
statements: still one round trip, only parsed each time. Prepared statement names end with a
digest of their SQL text, so two releases sharing pooled server sessions never run each other's
statements. This module is the only one that reaches below psycopg's public connection API; its
one entry point is `Channel.execute`, and it waits on the socket itself.
"""

from __future__ import annotations

import hashlib
import operator
import re
import select
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any, Final, LiteralString

import psycopg
from psycopg import adapt, pq
from psycopg import errors as pg_errors
from psycopg.abc import Transformer
from psycopg.adapt import PyFormat
from psycopg.pq.abc import PGconn, PGresult

from agent_runs.sql import query

_PLACEHOLDER: Final = re.compile(r"%\((\w+)\)s")

_TUPLES_OK: Final = pq.ExecStatus.TUPLES_OK
_OK: Final = pq.ExecStatus.COMMAND_OK
_FATAL_ERROR: Final = pq.ExecStatus.FATAL_ERROR
_PIPELINE_SYNC: Final = pq.ExecStatus.PIPELINE_SYNC
_IDLE: Final = pq.TransactionStatus.IDLE
_PIPELINE_OFF: Final = pq.PipelineStatus.OFF
_BINARY: Final = pq.Format.BINARY
_CONN_OK: Final = pq.ConnStatus.OK

PIPELINE_SUPPORTED: Final = psycopg.Pipeline.is_supported()


@dataclass(frozen=True, slots=True)
class Statement:
    """sql/<name>.sql as a server-side prepared statement: %(param)s placeholders as $n."""

    name: LiteralString  # the prepared statement's name on the server
    sql: LiteralString  # the file's SQL with $1, $2, … in place of its named placeholders
    params: tuple[str, ...]  # parameter names, in $n order

    @property
    def prepare(self) -> LiteralString:
        """The same statement as an SQL-level PREPARE (for EXPLAIN in tests and by hand)."""
        return f"PREPARE {self.name} AS\n{self.sql}"


@cache
def statement(name: str) -> Statement:
    params: list[str] = []

    def number(match: re.Match[str]) -> str:
        if match.group(1) not in params:
            params.append(match.group(1))
        return f"${params.index(match.group(1)) + 1}"

    # Comment lines may mention a placeholder too; only the statement's own count.
    body = "\n".join(line for line in query(name).splitlines() if not line.startswith("--"))
    sql = _PLACEHOLDER.sub(number, body)
    # Derived only from the shipped .sql file and its fixed name: literal SQL, never input.
    return Statement(name=_statement_name(name, sql), sql=sql, params=tuple(params))


def _statement_name(name: str, sql: str) -> LiteralString:
    """agent_runs_<name>_<digest of the SQL>: a release whose SQL differs uses other names."""
    digest = hashlib.sha256(sql.encode()).hexdigest()[:10]
    # Only [a-z0-9_.] from a shipped file name (`.` written `_`) and a hex digest: safe as an
    # SQL identifier.
    return f"agent_runs_{name.replace('.', '_')[:40]}_{digest}"


# -- rows --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """The columns of one statement's result, by name."""

    index: Mapping[str, int]
    _pickers: dict[str, Callable[[Sequence[Any]], tuple[Any, ...]] | None] = field(
        default_factory=dict, compare=False
    )

    def picker(
        self, key: str, wanted: tuple[str, ...]
    ) -> Callable[[Sequence[Any]], tuple[Any, ...]] | None:
        """A function taking the `wanted` columns, in that order, out of a row (None if one is
        missing); made once per shape and `key`."""
        try:
            return self._pickers[key]
        except KeyError:
            index = self.index
            found = None
            if all(n in index for n in wanted):
                positions = [index[n] for n in wanted]
                getter = operator.itemgetter(*positions)
                found = getter if len(positions) > 1 else lambda row: (getter(row),)
            self._pickers[key] = found
            return found


@lru_cache(maxsize=128)
def shape(names: tuple[str, ...]) -> Shape:
    index: dict[str, int] = {}
    for position, name in enumerate(names):
        index.setdefault(name, position)
    return Shape(index=index)


class Row:
    """One result row: its values as a tuple, read by column name through the result's shape."""

    __slots__ = ("shape", "values")

    def __init__(self, shape: Shape, values: Sequence[Any]) -> None:
        self.shape = shape
        self.values = values

    def __getitem__(self, name: str) -> Any:
        return self.values[self.shape.index[name]]


def shape_of(cur: psycopg.Cursor[Any]) -> Shape:
    """The shape of a classic cursor's current result."""
    return shape(tuple(column.name for column in cur.description or ()))


def rows_of(cur: psycopg.Cursor[Any]) -> list[Row]:
    """The rows of a classic cursor's current result."""
    rows = cur.fetchall()  # first: in the caller's pipeline, only fetching syncs the result
    found = shape_of(cur)
    return [Row(found, values) for values in rows]


# -- one server session's prepared statements ---------------------------------------------------


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
    return _Prepared(_statement_name(sql.decode().lower(), sql.decode()).encode(), sql)


# The transaction's own statements, prepared once per session like the transitions, so that
# BEGIN and COMMIT cost the server no parsing either.
_BEGIN: Final = _named(b"BEGIN")
_COMMIT: Final = _named(b"COMMIT")


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
                    unprepared = [s for s in (_BEGIN, main, _COMMIT) if s.name not in prepared]
                    for missing in unprepared:
                        pgconn.send_prepare(missing.name, missing.sql)
                    pgconn.send_query_prepared(_BEGIN.name, None)
                    pgconn.send_query_prepared(main.name, values, result_format=_BINARY)
                    pgconn.send_query_prepared(_COMMIT.name, None)
                else:  # unnamed statements: parsed each time, in the same single round trip
                    pgconn.send_query_params(_BEGIN.sql, None)
                    pgconn.send_query_params(main.sql, values, result_format=_BINARY)
                    pgconn.send_query_params(_COMMIT.sql, None)
                pgconn.pipeline_sync()
                synced = True
                results = _exchange(pgconn)
            except BaseException:
                _abandon(pgconn, synced=synced)
                raise
            pgconn.exit_pipeline_mode()
            if pgconn.transaction_status != _IDLE:  # the statement failed inside BEGIN … COMMIT
                _rollback(pgconn, deadline=None)
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


# -- the socket --------------------------------------------------------------------------------

_READ: Final = select.POLLIN if hasattr(select, "POLLIN") else 1
_WRITE: Final = select.POLLOUT if hasattr(select, "POLLOUT") else 4


def _wait(pgconn: PGconn, events: int, deadline: float | None) -> int:
    """Block until the connection's socket is ready for `events` (or errors); the ready events.
    Raises TimeoutError past `deadline` (time.monotonic())."""
    fileno = pgconn.socket
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(fileno, events)
            ready = poller.poll(None if timeout is None else timeout * 1000)
            if ready:
                return ready[0][1]
        else:  # pragma: no cover - platforms without poll()
            readable, writable, broken = select.select(
                [fileno] if events & _READ else [],
                [fileno] if events & _WRITE else [],
                [fileno],
                timeout,
            )
            if readable or writable or broken:
                return (_READ if readable or broken else 0) | (_WRITE if writable else 0)
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError("the server did not answer in time")


def _flush(pgconn: PGconn, deadline: float | None) -> None:
    """Send everything libpq holds, reading meanwhile so that a full socket cannot deadlock."""
    while pgconn.flush():
        if _wait(pgconn, _READ | _WRITE, deadline) & _READ:
            pgconn.consume_input()


def _read(pgconn: PGconn, deadline: float | None) -> None:
    """Read from the socket until a whole result is in."""
    while pgconn.is_busy():
        _wait(pgconn, _READ, deadline)
        pgconn.consume_input()


def _exchange(pgconn: PGconn) -> list[PGresult]:
    """Flush the pipeline and read one result per command, up to the Sync.

    The server answers the whole pipeline at once, so after the first wait every result is
    usually in libpq's buffer already, and is read straight from it. Each command's result is
    followed by a NULL that libpq hands out without reading, so only a command's first result
    needs the check that it is whole (each wait releases the GIL: when threads share the
    process, every release can hand the GIL to another thread and back, so they are kept few).
    """
    _flush(pgconn, None)
    results: list[PGresult] = []
    while True:
        if pgconn.is_busy():
            _read(pgconn, None)
        result = pgconn.get_result()
        if result is None:  # pragma: no cover - libpq ends a command's results with one NULL
            continue
        if result.status == _PIPELINE_SYNC:
            break
        results.append(result)
        if pgconn.get_result() is not None:  # pragma: no cover - one result per command
            raise psycopg.InterfaceError("a pipelined command returned more than one result")
    handler = pgconn.notify_handler
    if handler is not None:  # the connection LISTENs: deliver what came with the answer
        while notify := pgconn.notifies():
            handler(notify)
    return results


_ABANDON_SECONDS: Final = 5.0


def _abandon(pgconn: PGconn, *, synced: bool) -> None:
    """Leave the connection usable after an interrupted exchange, or close it.

    Reads what is left up to the Sync, leaves pipeline mode and rolls back. A connection whose
    protocol state is unknown must not carry another transition, so if any of that fails or
    takes too long, it is closed (a pool replaces it).
    """
    if pgconn.status != _CONN_OK:
        return
    deadline = time.monotonic() + _ABANDON_SECONDS
    try:
        if pgconn.pipeline_status != _PIPELINE_OFF:
            if not synced:
                pgconn.pipeline_sync()
            _flush(pgconn, deadline)
            while True:
                _read(pgconn, deadline)
                result = pgconn.get_result()
                if result is not None and result.status == _PIPELINE_SYNC:
                    break
            pgconn.exit_pipeline_mode()
        _rollback(pgconn, deadline=deadline)
        if pgconn.transaction_status != _IDLE:
            raise psycopg.InterfaceError("the connection is still inside a transaction")
    except BaseException:
        # The error to report is the one that interrupted the exchange, not this one.
        pgconn.finish()


def _rollback(pgconn: PGconn, *, deadline: float | None) -> None:
    """End a transaction whose COMMIT did not run (the caller holds the connection's lock)."""
    if pgconn.status != _CONN_OK or pgconn.transaction_status == _IDLE:
        return
    # The error to report is the original one: a failed rollback leaves the connection to die.
    try:
        pgconn.send_query(b"ROLLBACK")
        _flush(pgconn, deadline)
        while True:
            _read(pgconn, deadline)
            if pgconn.get_result() is None:
                return
    except (psycopg.Error, TimeoutError):
        if deadline is not None:
            raise


def pooled(conn: psycopg.Connection[Any]) -> bool:
    """True for a connection checked out of a psycopg_pool pool (it goes back to the pool)."""
    return getattr(conn, "_pool", None) is not None
