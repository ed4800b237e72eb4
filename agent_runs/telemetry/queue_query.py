"""The query behind agent_runs.telemetry's queue gauges: one grouped read per collection.

It runs in a READ ONLY transaction of its own with a short statement timeout (`SET LOCAL`, so it
also holds behind a transaction pooler), unprepared, through a pool (checked out for the read
only) or a connection the repository shares (taking turns with its calls).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import tuple_row
from psycopg_pool import ConnectionPool

from agent_runs.sql import query
from agent_runs.turns import turns

Rows = list[tuple[str, str, int, float | None]]


def queue_reader(source: Any, *, timeout_seconds: float) -> Callable[[], Rows]:
    """A function that reads the live queue through `source` (ConnectionPool or Connection)."""
    timeout_ms = max(1, int(timeout_seconds * 1000))
    set_timeout = sql.SQL("SET LOCAL statement_timeout = {}").format(sql.Literal(timeout_ms))

    def read_on(conn: psycopg.Connection[Any]) -> Rows:
        with conn.transaction():
            cur = conn.cursor(row_factory=tuple_row)  # whatever the connection's factory
            cur.execute("SET TRANSACTION READ ONLY", prepare=False)
            cur.execute(set_timeout, prepare=False)  # SET takes no parameters: a literal
            cur.execute(query("telemetry_queue"), {"now": None}, prepare=False)
            return [(str(s), str(a), int(n), o) for s, a, n, o in cur.fetchall()]

    if isinstance(source, ConnectionPool):
        pool: ConnectionPool[Any] = source

        def read() -> Rows:
            with pool.connection(timeout=timeout_seconds) as conn:
                return read_on(conn)

        return read
    conn: psycopg.Connection[Any] = source

    def read_shared() -> Rows:
        with turns(conn):
            # Never inside a transaction the application holds open on its connection.
            if conn.info.transaction_status.name != "IDLE":
                raise RuntimeError("the connection is inside a transaction; skipped")
            return read_on(conn)

    return read_shared
