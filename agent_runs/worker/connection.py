"""A database connection for one worker call: pooled, or direct while the pool backs off."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

# How long a checkout waits for the pool before connecting directly.
POOL_WAIT_SECONDS: Final = 0.5


@contextmanager
def connection(pool: ConnectionPool, *, timeout: float) -> Iterator[psycopg.Connection[Any]]:
    """A pooled connection or, while the pool is still backing off after an outage, a direct one.

    psycopg_pool waits 1, 2, 4 … seconds between reconnection attempts: after a server restart
    it can keep failing checkouts for seconds while the server is already back, and a lease
    would expire meanwhile. A direct connection answers as soon as the server does.
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
        pool.putconn(conn)
