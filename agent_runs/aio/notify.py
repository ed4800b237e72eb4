"""wait_for_run for asyncio: await a run's end, woken by agent_runs_finished, with the rules of
the synchronous one (agent_runs.notify): the poll fallback, a deadline that holds under a flood
of other runs' notifications (the clock is read at each one; a flooded waiter stops listening
and polls)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
from psycopg import errors as pg_errors

from agent_runs import validation as check
from agent_runs import waiters
from agent_runs.aio.driver import idle
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
    terminal after `timeout_seconds`. `conn` must be an idle autocommit AsyncConnection; it
    LISTENs on agent_runs_finished only during the call and is left idle afterwards (closed if a
    cancellation left it in an unknown state). Cancel it, or wrap it in `asyncio.timeout`,
    freely.
    """
    run_id = check.identifier("run_id", run_id)
    timeout = check.timeout_seconds(timeout_seconds)
    if not conn.autocommit or not idle(conn):
        raise InvalidArgument("conn must be an idle autocommit connection (LISTEN needs it)")
    waiter = _Waiter(conn, run_id, deadline=time.monotonic() + timeout)
    # Register, then LISTEN, before the first read (as agent_runs.notify.wait_for_run): a run
    # that ends after the read is then always notified (its end notifies only registered runs),
    # one that ended before LISTEN is terminal in the read.
    waiter_id = waiters.new_waiter_id()
    registered = False
    try:
        registered = await _register(conn, run_id, waiter_id, timeout)
        await conn.execute(_LISTEN_FINISHED, prepare=False)
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
        await _unlisten(conn, (run_id, waiter_id) if registered else None)


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
        others = 0
        async for notify in self.conn.notifies(timeout=max(0.0, until - time.monotonic())):
            if notify.channel == FINISHED_CHANNEL and notify.payload == self.run_id:
                return
            others += 1
            if others > FLOOD_NOTIFICATIONS:
                # Every statement on this connection would queue behind others' notifications:
                # stop them at their source, drop what came before UNLISTEN, and poll.
                self.listening = False
                await self.conn.execute(_UNLISTEN_FINISHED, prepare=False)
                async for _ in self.conn.notifies(timeout=0):
                    if time.monotonic() >= self.deadline:
                        break
                return
            if time.monotonic() >= until:
                return


async def _register(
    conn: psycopg.AsyncConnection[Any], run_id: str, waiter_id: str, timeout: float
) -> bool:
    """agent_runs.waiters.register on an async connection (same statement, same lock wait)."""
    lock_wait, sql, params = waiters.register_statement(run_id, waiter_id, timeout)
    try:
        async with conn.transaction():
            await conn.execute(waiters.LOCK_TIMEOUT, [lock_wait], prepare=False)
            cur = await conn.execute(sql, params, prepare=False)
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
    if idle(conn) and not conn.broken:
        if registration is not None:
            await conn.execute(*waiters.unregister_statement(*registration), prepare=False)
        await conn.execute(_UNLISTEN_FINISHED, prepare=False)
    else:
        await conn.close()
