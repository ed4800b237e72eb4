"""SyncDriver: how the synchronous repository carries out its plans (agent_runs.steps) on one
psycopg connection: a transition in one round trip through the pipelined transport, threads
sharing the connection taking turns call by call."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg.rows import tuple_row

from agent_runs.sql import query
from agent_runs.steps import Done, Execute, Failed, Plan, Step, Stream, Transaction, next_step, pull
from agent_runs.transport import Channel, Row, Statement, pooled, rows_of
from agent_runs.turns import turns

if TYPE_CHECKING:  # never imported at run time: telemetry off costs no import
    from agent_runs.telemetry import Telemetry

_T = TypeVar("_T")


class SyncDriver:
    """The synchronous face's plumbing: runs plans on `self.conn`."""

    def __init__(
        self, conn: psycopg.Connection[Any], *, telemetry: Telemetry | None = None
    ) -> None:
        self.conn = conn
        # OpenTelemetry spans and metrics (agent_runs.telemetry); None: off, one check per call.
        self.telemetry = telemetry
        if telemetry is not None and not pooled(conn):  # a pool's goes back: not for gauges
            telemetry.observe_through(conn)
        # Each thread's Channel to the connection: its adapters, reused across calls.
        self._local = threading.local()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """A transaction of yours around several calls that holds the connection's turn: calls
        from other threads sharing the connection wait until it ends instead of running inside
        it. (A plain `conn.transaction()` belongs to the connection: calls from any thread made
        while it is open become savepoints in it.)"""
        with turns(self.conn), self.conn.transaction():
            yield

    def _drive(self, plan: Plan[_T]) -> _T:
        """Carry a call's plan out, holding the connection's turn from start to end."""
        with turns(self.conn):
            return self._through(plan, inside=False)

    def _through(self, plan: Plan[_T], *, inside: bool) -> _T:
        answer: object = None
        try:
            while True:
                answer = self._answer(next_step(plan, answer), inside=inside)
        except StopIteration as done:
            value: _T = done.value
            return value

    def _iterate(self, stream: Stream[_T]) -> Iterator[_T]:
        """Hand out a stream's items, each fetched as a call of its own."""
        while not isinstance(item := self._drive(pull(stream)), Done):
            yield item.value

    def _answer(self, step: Step, *, inside: bool) -> object:
        """A step's answer (rows, or a sub-plan's value), or its database error as Failed."""
        try:
            if isinstance(step, Transaction):
                with self.conn.transaction():
                    return self._through(step.plan, inside=True)
            if inside:
                return self._statement(step)
            return self._execute(step.stmt, step.params)
        except psycopg.Error as exc:
            return Failed(exc)

    def _statement(self, step: Execute) -> list[Row]:
        """One statement in the transaction that is open (never prepared: see _execute), read
        as tuples whatever row factory the connection has."""
        cur = self.conn.cursor(row_factory=tuple_row)
        cur.execute(query(step.stmt.file), step.params, prepare=False)
        return rows_of(cur)

    def _execute(self, stmt: Statement, params: Mapping[str, Any]) -> list[Row]:
        """Run a statement in its own explicit transaction and return its rows."""
        rows = self._channel().execute(stmt, [params[param] for param in stmt.params])
        if rows is not None:
            return rows
        # Inside the caller's transaction this is a savepoint around the statement. Never
        # prepared: psycopg's statement names (_pg3_0, …) say nothing of their SQL, so behind a
        # pooler another client's statement of the same name could answer.
        with self.conn.transaction():
            return self._statement(Execute(stmt, params))

    def _channel(self) -> Channel:
        local = self._local
        channel: Channel | None = getattr(local, "channel", None)
        if channel is None or channel.conn is not self.conn:
            channel = local.channel = Channel(self.conn)
        return channel
