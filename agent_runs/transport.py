"""How a transition reaches PostgreSQL: its own explicit transaction, in one round trip.

`BEGIN`, the transition's prepared statement and `COMMIT` go out as one libpq pipeline (one
write), and their results come back together (one read): an explicit transaction that costs
the network and the server no more than an autocommit statement. The statement is prepared on
the server once per session, in the same pipeline as its first use. Its parameters travel as
text, typed by the prepared statement itself; its rows come back in binary (no timestamp or
JSON text to format on the server and parse here).

Where that path does not apply (inside the caller's transaction, in the caller's own pipeline,
on a libpq without pipeline mode), the repository runs the same SQL the classic way.
"""

from __future__ import annotations

import contextlib
import operator
import re
import weakref
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from typing import Any, Final, LiteralString

import psycopg
from psycopg import adapt, generators, pq
from psycopg import errors as pg_errors
from psycopg.abc import Transformer
from psycopg.adapt import PyFormat
from psycopg.pq.abc import PGconn, PGresult
from psycopg.waiting import Ready, Wait

from agent_runs.sql import query

_PLACEHOLDER: Final = re.compile(r"%\((\w+)\)s")

_TUPLES_OK: Final = pq.ExecStatus.TUPLES_OK
_OK: Final = pq.ExecStatus.COMMAND_OK
_FATAL_ERROR: Final = pq.ExecStatus.FATAL_ERROR
_PIPELINE_SYNC: Final = pq.ExecStatus.PIPELINE_SYNC
_IDLE: Final = pq.TransactionStatus.IDLE
_PIPELINE_OFF: Final = pq.PipelineStatus.OFF
_BINARY: Final = pq.Format.BINARY
_WAIT_R: Final = Wait.R

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
    return Statement(name=f"agent_runs_{name}", sql=sql, params=tuple(params))


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
    """What one server session has prepared, and the result shapes of its statements.

    A prepared statement's result shape cannot change within its session (PostgreSQL refuses:
    "cached plan must not change result type"), so a shape seen once stays right.
    """

    prepared: set[bytes] = field(default_factory=set)  # statement names
    shapes: dict[str, Shape] = field(default_factory=dict)


# Keyed by the PGconn, which lives exactly as long as its server session. The values hold no
# reference back to the connection, so a closed connection's entry goes away with it.
_sessions: weakref.WeakKeyDictionary[PGconn, _Session] = weakref.WeakKeyDictionary()


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


# The transaction's own statements, prepared once per session like the transitions, so that
# BEGIN and COMMIT cost the server no parsing either.
_BEGIN: Final = _Prepared(b"agent_runs_begin", b"BEGIN")
_COMMIT: Final = _Prepared(b"agent_runs_commit", b"COMMIT")


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
        this process thought (DISCARD ALL, someone else's PREPARE), it learns what they are and
        tries again: nothing was written. Where they never hold still (a pooler handing out
        server sessions that do not keep them), it answers None after a few tries.
        """
        for _ in range(3):
            outcome = self._attempt(stmt, args)
            if not isinstance(outcome, psycopg.Error):
                return outcome
            if not isinstance(outcome, _STALE):
                raise outcome
        return None

    def _attempt(self, stmt: Statement, args: Sequence[Any]) -> list[Row] | psycopg.Error | None:
        conn, pgconn, session = self.conn, self.pgconn, self.session
        prepared = session.prepared
        main = _prepared(stmt)
        values = self.tx.dump_sequence(args, [PyFormat.TEXT] * len(args))
        with conn.lock:
            if not self._free():
                return None
            unprepared = [s for s in (_BEGIN, main, _COMMIT) if s.name not in prepared]
            pgconn.enter_pipeline_mode()
            try:
                for missing in unprepared:
                    pgconn.send_prepare(missing.name, missing.sql)
                pgconn.send_query_prepared(_BEGIN.name, None)
                pgconn.send_query_prepared(main.name, values, result_format=_BINARY)
                pgconn.send_query_prepared(_COMMIT.name, None)
                pgconn.pipeline_sync()
                results = _exchange(conn)
            except BaseException:
                _abandon(conn)
                raise
            pgconn.exit_pipeline_mode()
            if pgconn.transaction_status != _IDLE:  # the statement failed inside BEGIN … COMMIT
                _rollback(conn)
        for missing, parsed in zip(unprepared, results, strict=False):
            if parsed.status == _OK or _sqlstate(parsed) == _DUPLICATE_STATEMENT:
                prepared.add(missing.name)  # made now, or made before by another path
        # After an error, every later command of the pipeline comes back PIPELINE_ABORTED.
        failed = next((r for r in results if r.status == _FATAL_ERROR), None)
        if failed is not None:
            if _sqlstate(failed) == _UNKNOWN_STATEMENT:
                prepared.clear()  # DISCARD ALL, or a pooler moved us to another session
            return pg_errors.error_from_result(failed, encoding=conn.info.encoding)
        result = results[-2]
        found = session.shapes.get(stmt.name)
        if found is None:
            names = tuple((result.fname(i) or b"").decode() for i in range(result.nfields))
            found = session.shapes[stmt.name] = shape(names)
        tx = self.tx
        tx.set_pgresult(result)
        return [Row(found, values) for values in tx.load_rows(0, result.ntuples, tuple)]


_UNKNOWN_STATEMENT: Final = b"26000"  # invalid_sql_statement_name
_DUPLICATE_STATEMENT: Final = b"42P05"  # duplicate_prepared_statement
# Failures that only mean our idea of the session's prepared statements was wrong.
_STALE: Final = (pg_errors.InvalidSqlStatementName, pg_errors.DuplicatePreparedStatement)


def _sqlstate(result: PGresult) -> bytes | None:
    return result.error_field(pq.DiagnosticField.SQLSTATE)


def _exchange(conn: psycopg.Connection[Any]) -> list[PGresult]:
    """Flush the pipeline and read one result per command, up to the Sync.

    The server answers the whole pipeline at once, so after the first wait every result is
    usually in libpq's buffer already, and is read straight from it. Each command's result is
    followed by a NULL that libpq hands out without reading, so only a command's first result
    needs the check that it is whole (which releases the GIL: when threads share the process,
    every release can hand the GIL to another thread and back, so they are kept few).
    """
    pgconn = conn.pgconn
    conn.wait(generators.send(pgconn))
    results: list[PGresult] = []
    while True:
        if pgconn.is_busy():
            conn.wait(_input(pgconn))
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


def _input(pgconn: PGconn) -> Generator[Wait, Ready | int, None]:
    """Wait for the socket and read from it until a whole result is in."""
    while True:
        ready = yield _WAIT_R
        if ready:
            pgconn.consume_input()
            if not pgconn.is_busy():
                return


def _abandon(conn: psycopg.Connection[Any]) -> None:
    """Leave the connection usable after an interrupted exchange, or close it.

    Reads what is left up to the Sync, leaves pipeline mode and rolls back. A connection whose
    protocol state is unknown must not carry another transition, so if any of that fails, it is
    closed (a pool replaces it).
    """
    pgconn = conn.pgconn
    if pgconn.status != pq.ConnStatus.OK:
        return
    try:
        if pgconn.pipeline_status != _PIPELINE_OFF:
            group = conn.wait(generators.fetch_many(pgconn), timeout=5.0)
            while not (group and group[0].status == _PIPELINE_SYNC):
                group = conn.wait(generators.fetch_many(pgconn), timeout=5.0)
            pgconn.exit_pipeline_mode()
        _rollback(conn)
    except BaseException:
        # The error to report is the one that interrupted the exchange, not this one.
        pgconn.finish()


def _rollback(conn: psycopg.Connection[Any]) -> None:
    """End a transaction whose COMMIT did not run (the caller holds conn.lock)."""
    pgconn = conn.pgconn
    if pgconn.status != pq.ConnStatus.OK or pgconn.transaction_status == _IDLE:
        return
    pgconn.send_query(b"ROLLBACK")
    # The error to report is the original one: a failed rollback leaves the connection to die.
    with contextlib.suppress(psycopg.Error):
        conn.wait(generators.execute(pgconn))
