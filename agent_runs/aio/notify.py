"""wait_for_run for asyncio: await a run's end, woken by agent_runs_finished, with the rules of
the synchronous one (agent_runs.notify): the poll fallback, a deadline that holds under a flood
of other runs' notifications (the clock is read at each one; a flooded waiter stops listening
and polls)."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import Any, LiteralString

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import tuple_row

from agent_runs import validation as check
from agent_runs import waiters
from agent_runs.aio.driver import idle, turn
from agent_runs.aio.repository import AsyncAgentRunRepository
from agent_runs.errors import InvalidArgument
from agent_runs.models import AgentRun
from agent_runs.notify import (
    _LISTEN_FINISHED,
    _UNLISTEN_FINISHED,
    FINISHED_CHANNEL,
    FLOOD_NOTIFICATIONS,
    FLOODED_POLL_SECONDS,
    WAIT_POLL_SECONDS,
)


async def wait_for_run(
    conn: psycopg.AsyncConnection[Any], run_id: str, *, timeout_seconds: float
) -> AgentRun:
    """Await run `run_id` being terminal and return it.

    Raises InvalidArgument for bad arguments or an unknown run, TimeoutError when the run is not
    terminal after `timeout_seconds`. `conn` must be an idle autocommit AsyncConnection, of any
    row factory; it LISTENs on agent_runs_finished only during the call and is left idle
    afterwards (closed if a cancellation left it in an unknown state). Its statements take
    turns with other tasks' repository calls on `conn`, never running inside their
    transaction(). Cancel it, or wrap it in `asyncio.timeout`, freely.
    """
    run_id = check.identifier("run_id", run_id)
    timeout = check.timeout_seconds(timeout_seconds)
    if not conn.autocommit:
        raise InvalidArgument("conn must be an idle autocommit connection (LISTEN needs it)")
    waiter = _Waiter(conn, run_id, deadline=time.monotonic() + timeout)
    # Register, then LISTEN, before the first read (as agent_runs.notify.wait_for_run): a run
    # that ends after the read is then always notified (its end notifies only registered runs),
    # one that ended before LISTEN is terminal in the read.
    waiter_id = waiters.new_waiter_id()
    registration: tuple[str, str] | None = None
    async with turn(conn, timeout=timeout):
        if not idle(conn):
            raise InvalidArgument("conn must be an idle autocommit connection (LISTEN needs it)")
        try:
            if await _register(conn, run_id, waiter_id, timeout):
                registration = (run_id, waiter_id)
            await _execute(conn, _LISTEN_FINISHED)
        except BaseException:
            await _unlisten(conn, registration)
            raise
    try:
        run = await waiter.read("no such run")
        while not run.is_terminal:
            if time.monotonic() >= waiter.deadline:
                raise TimeoutError(
                    f"run {run_id!r} is still {run.status} after {timeout:g} seconds"
                )
            await waiter.pause()
            run = await waiter.read("the run was deleted while waiting")
        return run
    finally:
        await _unlisten(conn, registration)


class _Waiter:
    """One wait_for_run call: its connection, run, deadline, and whether it still listens."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], run_id: str, deadline: float) -> None:
        self.conn = conn
        self.repo = AsyncAgentRunRepository(conn)
        self.run_id = run_id
        self.deadline = deadline
        self.listening = True

    async def read(self, missing: str) -> AgentRun:
        run = await self.repo.get_run(self.run_id)
        if run is None:
            raise InvalidArgument(f"run_id {self.run_id!r}: {missing}")
        return run

    async def pause(self) -> None:
        """Until the run's notification, the poll interval, or the deadline, whichever is first;
        a flooded connection stops listening, and the waiter polls from then on."""
        until = min(self.deadline, time.monotonic() + WAIT_POLL_SECONDS)
        if not self.listening:
            await asyncio.sleep(min(FLOODED_POLL_SECONDS, max(0.0, until - time.monotonic())))
            return
        if await self._flooded(until):
            # Every statement on this connection would queue behind others' notifications:
            # stop them at their source, drop what came before UNLISTEN, and poll.
            self.listening = False
            async with turn(self.conn):
                await _execute(self.conn, _UNLISTEN_FINISHED)
            # notifies() holds the connection until it is closed: closed before any statement.
            async with aclosing(self.conn.notifies(timeout=0)) as received:
                async for _ in received:
                    if time.monotonic() >= self.deadline:
                        break

    async def _flooded(self, until: float) -> bool:
        """Read notifications until the run's, or `until`; True when others flooded in (more
        than FLOOD_NOTIFICATIONS)."""
        others = 0
        async with aclosing(self.conn.notifies(timeout=max(0.0, until - time.monotonic()))) as got:
            async for notify in got:
                if notify.channel == FINISHED_CHANNEL and notify.payload == self.run_id:
                    return False
                others += 1
                if others > FLOOD_NOTIFICATIONS:
                    return True
                if time.monotonic() >= until:
                    return False
        return False


async def _register(
    conn: psycopg.AsyncConnection[Any], run_id: str, waiter_id: str, timeout: float
) -> bool:
    """agent_runs.waiters.register on an async connection (same statement, same lock wait)."""
    lock_wait, sql, params = waiters.register_statement(run_id, waiter_id, timeout)
    try:
        async with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
            await cur.execute(waiters.LOCK_TIMEOUT, [lock_wait], prepare=False)
            await cur.execute(sql, params, prepare=False)
            return waiters.registered(await cur.fetchone())
    except pg_errors.LockNotAvailable:
        raise waiters.locked_too_long(run_id, timeout) from None


async def _unlisten(
    conn: psycopg.AsyncConnection[Any], registration: tuple[str, str] | None
) -> None:
    """Unregister and UNLISTEN on a connection left idle; close one a cancellation left anywhere
    else (a registration left behind expires, see agent_runs.waiters)."""
    if conn.closed:
        return
    async with turn(conn):
        if idle(conn) and not conn.broken:
            if registration is not None:
                await _execute(conn, *waiters.unregister_statement(*registration))
            await _execute(conn, _UNLISTEN_FINISHED)
        else:
            await conn.close()


async def _execute(
    conn: psycopg.AsyncConnection[Any], statement: LiteralString, params: Any = None
) -> None:
    """A statement whose rows nobody reads, never through the connection's row factory."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(statement, params, prepare=False)
