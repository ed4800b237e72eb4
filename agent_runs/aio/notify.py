"""wait_for_run for asyncio: await a run's end, woken by agent_runs_finished, with the same
poll fallback as the synchronous one (agent_runs.notify)."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from agent_runs import validation as check
from agent_runs.aio.driver import idle
from agent_runs.aio.repository import AsyncAgentRunRepository
from agent_runs.errors import InvalidArgument
from agent_runs.models import AgentRun
from agent_runs.notify import (
    _LISTEN_FINISHED,
    _UNLISTEN_FINISHED,
    FINISHED_CHANNEL,
    WAIT_POLL_SECONDS,
    _timeout_seconds,
)


async def wait_for_run(
    conn: psycopg.AsyncConnection[Any], run_id: str, *, timeout_seconds: float
) -> AgentRun:
    """Await run `run_id` being terminal and return it.

    Raises InvalidArgument for bad arguments or an unknown run, TimeoutError when the run is not
    terminal after `timeout_seconds`. `conn` must be an idle autocommit AsyncConnection; it
    LISTENs on agent_runs_finished only during the call and is left idle afterwards (closed if a
    cancellation left it in an unknown state). Wrap it in `asyncio.timeout` or cancel it freely.
    """
    run_id = check.identifier("run_id", run_id)
    timeout = _timeout_seconds(timeout_seconds)
    if not conn.autocommit or not idle(conn):
        raise InvalidArgument("conn must be an idle autocommit connection (LISTEN needs it)")
    repo = AsyncAgentRunRepository(conn)
    # LISTEN before the first read: a run that ends after the read is then always notified.
    await conn.execute(_LISTEN_FINISHED, prepare=False)
    try:
        run = await _read(repo, run_id, "no such run")
        try:
            async with asyncio.timeout(timeout if not run.is_terminal else None):
                while not run.is_terminal:
                    # A wake-up, or the poll interval: read the run again either way.
                    async for notify in conn.notifies(timeout=WAIT_POLL_SECONDS):
                        if notify.channel == FINISHED_CHANNEL and notify.payload == run_id:
                            break
                    run = await _read(repo, run_id, "the run was deleted while waiting")
        except TimeoutError:
            raise TimeoutError(
                f"run {run_id!r} is still {run.status} after {timeout:g} seconds"
            ) from None
        return run
    finally:
        await _unlisten(conn)


async def _read(repo: AsyncAgentRunRepository, run_id: str, missing: str) -> AgentRun:
    run = await repo.get_run(run_id)
    if run is None:
        raise InvalidArgument(f"run_id {run_id!r}: {missing}")
    return run


async def _unlisten(conn: psycopg.AsyncConnection[Any]) -> None:
    """UNLISTEN on a connection left idle; close one a cancellation left anywhere else."""
    if conn.closed:
        return
    if idle(conn) and not conn.broken:
        await conn.execute(_UNLISTEN_FINISHED, prepare=False)
    else:
        await conn.close()
