"""wait_for_run for asyncio: the synchronous one's plan (agent_runs.waiters), awaited on an
AsyncConnection and a listener of its own."""

from __future__ import annotations

import asyncio
import time
from contextlib import aclosing
from typing import Any, LiteralString

import psycopg
from psycopg import errors as pg_errors
from psycopg.rows import tuple_row

from agent_runs import waiters
from agent_runs.aio.driver import idle, turn
from agent_runs.aio.repository import AsyncAgentRunRepository
from agent_runs.errors import InvalidArgument
from agent_runs.logs import logger
from agent_runs.models import AgentRun
from agent_runs.steps import Failed, next_step
from agent_runs.waiters import WAIT_POLL_SECONDS

log = logger("agent_runs.notify")


async def wait_for_run(
    conn: psycopg.AsyncConnection[Any], run_id: str, *, timeout_seconds: float
) -> AgentRun:
    """Await run `run_id` being terminal and return it.

    Raises InvalidArgument for bad arguments or an unknown run, TimeoutError when the run is not
    terminal after `timeout_seconds`. `conn` must be an idle autocommit AsyncConnection, of any
    row factory; it registers the wait, reads the run and unregisters, and is left idle
    afterwards (closed if a cancellation left it in an unknown state). Its statements take
    turns with other tasks' repository calls on `conn`, never running inside their
    transaction(). While the run is not terminal the wait LISTENs on agent_runs_finished on a
    connection of its own, opened as `conn` was and closed when the wait returns. Cancel it, or
    wrap it in `asyncio.timeout`, freely.
    """
    plan = waiters.wait_plan(run_id, timeout_seconds, poll_seconds=WAIT_POLL_SECONDS)
    return await _AsyncWait(conn).drive(plan)


class _AsyncWait:
    """Awaits a wait's steps (agent_runs.waiters) on `conn` and a listener of its own."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.listener: psycopg.AsyncConnection[Any] | None = None

    async def drive(self, plan: waiters.WaitPlan) -> AgentRun:
        answer: object = None
        while True:
            try:
                step = next_step(plan, answer)
            except StopIteration as stop:
                run: AgentRun = stop.value
                return run
            try:
                answer = await self.carry_out(step)
            except BaseException as exc:  # thrown into the plan, which cleans up and re-raises
                answer = Failed(exc)

    async def carry_out(self, step: waiters.WaitStep) -> object:
        match step:
            case waiters.Register():
                return await self.register(step)
            case waiters.Listen():
                return await self.listen()
            case waiters.Read(run_id=run_id):
                return await AsyncAgentRunRepository(self.conn).get_run(run_id)
            case waiters.Hear():
                return await self.hear(step)
            case waiters.Sleep(until=until):
                await asyncio.sleep(max(0.0, until - time.monotonic()))
            case waiters.StopListening():
                await self.stop_listening()
            case waiters.Unregister(run_id=run_id, waiter_id=waiter_id):
                await self.unregister(run_id, waiter_id)
        return None

    async def register(self, step: waiters.Register) -> bool:
        conn = self.conn
        if not conn.autocommit:
            raise InvalidArgument(waiters.NOT_IDLE)
        async with turn(conn, timeout=step.timeout):
            if not idle(conn):
                raise InvalidArgument(waiters.NOT_IDLE)
            lock_wait, sql, params = waiters.register_statement(
                step.run_id, step.waiter_id, step.timeout
            )
            try:
                async with conn.transaction(), conn.cursor(row_factory=tuple_row) as cur:
                    await cur.execute(waiters.LOCK_TIMEOUT, [lock_wait], prepare=False)
                    await cur.execute(sql, params, prepare=False)
                    return waiters.registered(await cur.fetchone())
            except pg_errors.LockNotAvailable:
                raise waiters.locked_too_long(step.run_id, step.timeout) from None
            except BaseException:
                if not idle(conn):  # a cancellation left it mid-transaction: never reuse it
                    await conn.close()
                raise

    async def listen(self) -> bool:
        try:
            self.listener = await psycopg.AsyncConnection.connect(
                waiters.listener_conninfo(self.conn.info), **waiters.LISTENER_OPTIONS
            )
            await _execute(self.listener, waiters.LISTEN)
        except psycopg.Error as exc:
            log.debug("wait_for_run polls: its listener did not connect (%s)", type(exc).__name__)
            await self.stop_listening()
            return False
        return True

    async def hear(self, step: waiters.Hear) -> str:
        assert self.listener is not None
        hearing = waiters.Hearing(step)
        try:
            async with aclosing(self.listener.notifies(timeout=hearing.remaining())) as received:
                async for notify in received:
                    if verdict := hearing.verdict(notify.channel, notify.payload):
                        return verdict
        except psycopg.Error as exc:
            log.debug("wait_for_run polls: its listener failed (%s)", type(exc).__name__)
            return waiters.LOST
        return waiters.QUIET

    async def stop_listening(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            await listener.close()

    async def unregister(self, run_id: str, waiter_id: str) -> None:
        """On a connection left idle; one a cancellation left anywhere else is closed (its
        registration expires, see agent_runs.waiters)."""
        conn = self.conn
        if conn.closed:
            return
        async with turn(conn):
            if idle(conn) and not conn.broken:
                await _execute(conn, *waiters.unregister_statement(run_id, waiter_id))
            else:
                await conn.close()


async def _execute(
    conn: psycopg.AsyncConnection[Any], statement: LiteralString, params: Any = None
) -> None:
    """A statement whose rows nobody reads, never through the connection's row factory."""
    async with conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(statement, params, prepare=False)
