"""Asyncio connections and pools, as the async repository expects them (autocommit)."""

from __future__ import annotations

import inspect
from typing import Any, Final

import psycopg
from psycopg_pool import AsyncConnectionPool

from agent_runs.db import connection_options

# AsyncConnectionPool's own parameters; any other keyword given to create_pool is a connection
# option.
_POOL_PARAMETERS: Final = frozenset(inspect.signature(AsyncConnectionPool.__init__).parameters) - {
    "self",
    "conninfo",
}


async def connect(dsn: str, **kwargs: Any) -> psycopg.AsyncConnection[Any]:
    """A psycopg AsyncConnection in autocommit mode; repository methods make their own
    transactions. Other keywords are psycopg connection options, e.g. `prepare_threshold=None`
    behind a transaction pooler."""
    kwargs.setdefault("autocommit", True)
    return await psycopg.AsyncConnection.connect(dsn, **kwargs)


async def _configure(conn: psycopg.AsyncConnection[Any]) -> None:
    await conn.set_autocommit(True)


def create_pool(
    dsn: str, *, min_size: int = 1, max_size: int = 10, open: bool = False, **kwargs: Any
) -> AsyncConnectionPool:
    """A psycopg_pool.AsyncConnectionPool of autocommit connections, checked on checkout.

    Not opened here (psycopg_pool asks async pools to be opened in a running loop): use
    `async with create_pool(dsn) as pool:` or `await pool.open()`. Keywords that
    AsyncConnectionPool does not take are connection options for every connection it opens:
    `create_pool(dsn, prepare_threshold=None)`.
    """
    connection_options(kwargs, _POOL_PARAMETERS)
    kwargs.setdefault("configure", _configure)
    kwargs.setdefault("check", AsyncConnectionPool.check_connection)
    return AsyncConnectionPool(dsn, min_size=min_size, max_size=max_size, open=open, **kwargs)
