"""AsyncDriver: how the asyncio repository carries out its plans (agent_runs.steps) on one
psycopg AsyncConnection.

A transition is one statement: on an idle autocommit connection it runs alone, which makes it
its own transaction in one round trip (no BEGIN/COMMIT to wait for); inside a transaction of
the caller's it runs in a savepoint, as the synchronous face does. Statements are never
prepared (behind a transaction pooler psycopg's statement names could meet another client's).

Cancellation: psycopg answers a task cancelled while a statement runs by cancelling it on the
server and reading the connection back to idle (a statement cancelled there is rolled back
whole; one that had committed stays, and the CancelledError comes after it). Whatever
interrupts a call, a connection it cannot prove idle (or back in the caller's transaction) is
closed, so no later call, and no pool, can inherit a transaction in an unknown state.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, Final, TypeVar

import psycopg
from psycopg import pq
from psycopg.rows import tuple_row

from agent_runs.sql import query
from agent_runs.steps import Done, Execute, Failed, Plan, Step, Stream, Transaction, next_step, pull
from agent_runs.transport import Row, shape

if TYPE_CHECKING:  # never imported at run time: telemetry off costs no import
    from agent_runs.telemetry import Telemetry

_T = TypeVar("_T")
_IDLE: Final = pq.TransactionStatus.IDLE
_INTRANS: Final = pq.TransactionStatus.INTRANS
_INERROR: Final = pq.TransactionStatus.INERROR


def idle(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether `conn` is open and outside any transaction."""
    return not conn.closed and conn.info.transaction_status == _IDLE


class _Turn:
    """A connection's turn: held by a whole call or `transaction()`, so that tasks sharing the
    connection take turns, and the task that holds it (calls it makes inside its transaction
    run in it). Only that task: a task it starts is another task, however it copies its
    context, and waits for the turn like any other."""

    __slots__ = ("holder", "lock")

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.holder: asyncio.Task[Any] | None = None


_turns: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], _Turn] = weakref.WeakKeyDictionary()


def _turn_of(conn: psycopg.AsyncConnection[Any]) -> _Turn:
    found = _turns.get(conn)
    return _turns.setdefault(conn, _Turn()) if found is None else found


@asynccontextmanager
async def turn(
    conn: psycopg.AsyncConnection[Any], *, timeout: float | None = None
) -> AsyncIterator[None]:
    """Hold `conn`'s turn for the current task (at once if it holds it already); TimeoutError
    if the turn does not come within `timeout` seconds (None: wait as long as it takes)."""
    held = _turn_of(conn)
    task = asyncio.current_task()
    if task is not None and held.holder is task:
        yield
        return
    if timeout is None:
        await held.lock.acquire()
    else:
        try:
            async with asyncio.timeout(timeout):
                await held.lock.acquire()
        except TimeoutError:
            raise TimeoutError(
                f"the connection stayed busy with other tasks' calls for {timeout:g} seconds"
            ) from None
    held.holder = task
    try:
        yield
    finally:
        held.holder = None
        held.lock.release()


class AsyncDriver:
    """The asyncio face's plumbing: runs plans on `self.conn`."""

    def __init__(
        self, conn: psycopg.AsyncConnection[Any], *, telemetry: Telemetry | None = None
    ) -> None:
        self.conn = conn
        # Spans and metrics as the sync face records them (agent_runs.telemetry); the
        # observable queue gauges need a sync connection (Telemetry.observe_through).
        self.telemetry = telemetry

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        """A transaction of yours around several calls, holding the connection's turn for this
        task: other tasks' calls on the connection wait until it ends instead of running inside
        it, tasks started inside the block too (so a block that awaits such a task's call would
        wait for itself: make the calls in the block's own task). A call inside it is a
        savepoint; if the block raises (a cancellation too), it all rolls back."""
        async with turn(self.conn):
            before = self.conn.info.transaction_status
            try:
                async with self.conn.transaction():
                    yield
            except BaseException:
                await self._settle(before)
                raise

    async def _drive(self, plan: Plan[_T]) -> _T:
        """Carry a call's plan out, holding the connection's turn from start to end."""
        async with turn(self.conn):
            before = self.conn.info.transaction_status
            try:
                return await self._through(plan, inside=False)
            except BaseException:
                await self._settle(before)
                raise

    async def _through(self, plan: Plan[_T], *, inside: bool) -> _T:
        answer: object = None
        try:
            while True:
                answer = await self._answer(next_step(plan, answer), inside=inside)
        except StopIteration as done:
            value: _T = done.value
            return value

    async def _iterate(self, stream: Stream[_T]) -> AsyncIterator[_T]:
        """Hand out a stream's items, each fetched as a call of its own."""
        while not isinstance(item := await self._drive(pull(stream)), Done):
            yield item.value

    async def _answer(self, step: Step, *, inside: bool) -> object:
        """A step's answer (rows, or a sub-plan's value), or its database error as Failed."""
        conn = self.conn
        try:
            if isinstance(step, Transaction):
                async with conn.transaction():
                    return await self._through(step.plan, inside=True)
            if inside or (conn.autocommit and conn.info.transaction_status == _IDLE):
                return await self._statement(step)  # alone: its own transaction
            async with conn.transaction():  # a savepoint in the caller's transaction
                return await self._statement(step)
        except psycopg.Error as exc:
            return Failed(exc)

    async def _statement(self, step: Execute) -> list[Row]:
        cur = self.conn.cursor(binary=True, row_factory=tuple_row)
        await cur.execute(query(step.stmt.file), step.params, prepare=False)
        found = shape(tuple(column.name for column in cur.description or ()))
        return [Row(found, values) for values in await cur.fetchall()]

    async def _settle(self, before: pq.TransactionStatus) -> None:
        """After an interrupted call: close the connection unless it is where the call found it
        (idle, or inside the caller's transaction, perhaps failed, which its owner rolls back)."""
        conn = self.conn
        if conn.closed:
            return
        status = conn.info.transaction_status
        if status == _IDLE or (before != _IDLE and status in (_INTRANS, _INERROR)):
            return
        await conn.close()
