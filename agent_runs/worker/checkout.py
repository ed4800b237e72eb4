"""A database connection for one worker call: pooled, or direct while the pool backs off; and
the repositories the worker's parts make their calls with."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any, Final

import psycopg
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from agent_runs.repository import AgentRunRepository

if TYPE_CHECKING:  # telemetry off never imports it
    from agent_runs.telemetry import Telemetry

# A repository on a connection of its own for one call (`with repositories() as repo:`).
Repositories = Callable[[], AbstractContextManager[AgentRunRepository]]

# How long a checkout waits for the pool before connecting directly.
POOL_WAIT_SECONDS: Final = 0.5

# One sweep of a pool's idle connections at a time, whichever thread found a dead one.
_sweeping = threading.Lock()


@contextmanager
def connection(pool: ConnectionPool, *, timeout: float) -> Iterator[psycopg.Connection[Any]]:
    """A pooled connection or, while the pool is still backing off after an outage, a direct one.

    psycopg_pool waits 1, 2, 4 … seconds between reconnection attempts: after a server restart
    it can keep failing checkouts for seconds while the server is already back, and a lease
    would expire meanwhile. A direct connection answers as soon as the server does.

    A pooled connection that died under a call (a restart, a terminated backend, a dropped
    network path) rarely dies alone, and a pool may hand out its idle connections without a
    round trip to check them (the CLI's pool never checks; create_pool skips one returned
    moments ago): so the pool's idle connections are checked at once, and the next call (the
    heartbeat's retry above all) gets a live one instead of the next dead one.
    """
    try:
        # A healthy pool answers at once; waiting longer only waits out its back-off.
        conn = pool.getconn(timeout=min(timeout, POOL_WAIT_SECONDS))
    except PoolTimeout:
        conninfo = pool.conninfo() if callable(pool.conninfo) else pool.conninfo
        kwargs = (pool.kwargs() if callable(pool.kwargs) else pool.kwargs) or {}
        direct = psycopg.connect(conninfo, **{**kwargs, "autocommit": True, "connect_timeout": 2})
        with direct:
            yield direct
        return
    try:
        yield conn
    finally:
        died = conn.closed
        pool.putconn(conn)
        if died:
            _sweep(pool)


def repositories(
    pool: ConnectionPool, *, timeout: float, telemetry: Telemetry | None
) -> Repositories:
    """Repositories on `pool`'s connections (as `connection` hands them out) for one call each."""

    @contextmanager
    def repository() -> Iterator[AgentRunRepository]:
        with connection(pool, timeout=timeout) as conn:
            yield AgentRunRepository(conn, telemetry=telemetry)

    return repository


def _sweep(pool: ConnectionPool) -> None:
    """Check the pool's idle connections now, replacing the dead ones (psycopg_pool's check)."""
    if not _sweeping.acquire(blocking=False):
        return  # another thread is sweeping
    try:
        pool.check()
    except PoolClosed:
        pass
    finally:
        _sweeping.release()
