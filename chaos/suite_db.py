"""The suite's own database session, reconnected after any fault, and its small queries."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, Final, TypeVar

import psycopg

from chaos.faults import SUITE_APP, with_application_name

T = TypeVar("T")

DB_ERRORS: Final = (psycopg.OperationalError, psycopg.InterfaceError)


class SuiteDb:
    """The suite's own session (application_name chaos-suite), reconnected after any fault."""

    def __init__(self, dsn: str) -> None:
        self.dsn = with_application_name(dsn, SUITE_APP)
        self._conn: psycopg.Connection[Any] | None = None
        self.errors = 0

    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self.dsn,
                autocommit=True,
                connect_timeout=3,
                options="-c TimeZone=UTC -c statement_timeout=15000",
            )
        return self._conn

    def reset(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None

    def attempt(self, call: Callable[[psycopg.Connection[Any]], T]) -> T | None:
        """`call(conn)`, or None when the database failed it (the session is reset)."""
        try:
            return call(self.conn())
        except DB_ERRORS:
            self.errors += 1
            self.reset()
            return None

    def must(self, call: Callable[[psycopg.Connection[Any]], T], *, timeout: float = 60.0) -> T:
        """`call(conn)`, retried across database failures for up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return call(self.conn())
            except DB_ERRORS:
                self.errors += 1
                self.reset()
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.3)

    def close(self) -> None:
        self.reset()


def database_now(conn: psycopg.Connection[Any]) -> datetime:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    value: datetime = row[0]
    return value


def status_counts(conn: psycopg.Connection[Any]) -> dict[str, int]:
    rows = conn.execute("SELECT status, count(*) FROM agent_runs GROUP BY status").fetchall()
    return {str(r[0]): int(r[1]) for r in rows}
