"""The dashboard's reads: each request in one READ ONLY transaction with a statement timeout.

Listings, statistics and explanations come from the repository (`list_run_summaries`,
`run_stats`, `list_run_attempts`, `explain_run`); the few queries only the pages need
(live counts, runs per minute, per agent, per worker identity, the sub-agent tree) are
sql/dashboard.*.sql files run here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, LiteralString

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from agent_runs.repository import AgentRunRepository
from agent_runs.sql import query

# Rows shown per group on the overview and the workers page.
TOP: Final = 20
WORKERS_TOP: Final = 200
# Runs of a tree shown on the run page, and on the tree page behind its link.
TREE_ON_RUN_PAGE: Final = 50
TREE_PAGE: Final = 1000
CHILDREN: Final = 50
_NON_TERMINAL: Final = ("pending", "running", "cancel_requested")


class Reader:
    """The connection of one request, inside its read-only transaction."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.repo = AgentRunRepository(conn)

    def rows(self, sql: LiteralString, params: dict[str, Any]) -> list[dict[str, Any]]:
        with self.conn.cursor(row_factory=dict_row) as cur:
            cur.execute(sql, params, prepare=False)
            return [{k: _utc(v) for k, v in row.items()} for row in cur.fetchall()]

    def now(self) -> datetime:
        with self.conn.cursor() as cur:
            cur.execute("SELECT now()", prepare=False)
            row = cur.fetchone()
        assert row is not None
        value: datetime = row[0]
        return value.astimezone(UTC)


def _utc(value: Any) -> Any:
    return value.astimezone(UTC) if isinstance(value, datetime) else value


@contextmanager
def reading(pool: ConnectionPool, timeout_seconds: float) -> Iterator[Reader]:
    """A pooled connection in a READ ONLY transaction whose statements time out."""
    with pool.connection() as conn, conn.transaction():
        with conn.cursor() as cur:
            cur.execute(_begin(timeout_seconds, read_only=True), prepare=False)
        yield Reader(conn)


@contextmanager
def writing(pool: ConnectionPool, timeout_seconds: float) -> Iterator[Reader]:
    """A pooled connection in a read-write transaction whose statements time out (cancel)."""
    with pool.connection() as conn, conn.transaction():
        with conn.cursor() as cur:
            cur.execute(_begin(timeout_seconds, read_only=False), prepare=False)
        yield Reader(conn)


def _begin(timeout_seconds: float, *, read_only: bool) -> LiteralString:
    # An integer of our own settings, never a request's value; SET takes no parameters.
    milliseconds = max(1, round(timeout_seconds * 1000))
    mode: LiteralString = "READ ONLY" if read_only else "READ WRITE"
    digits = str(milliseconds)
    assert digits.isdigit()
    return f"SET TRANSACTION {mode}; SET LOCAL statement_timeout = {digits}"


@dataclass(frozen=True, slots=True)
class Live:
    """Non-terminal runs now: count, expired leases and oldest creation per status."""

    counts: dict[str, int]
    expired: dict[str, int]
    oldest: dict[str, datetime]
    in_recovery: bool


def live(reader: Reader) -> Live:
    rows = reader.rows(query("dashboard.live"), {"now": None})
    in_recovery = any(bool(r["in_recovery"]) for r in rows if r["key"] == "in_recovery")
    runs = [r for r in rows if r["key"] in _NON_TERMINAL]
    return Live(
        counts={s: next((int(r["n"]) for r in runs if r["key"] == s), 0) for s in _NON_TERMINAL},
        expired={r["key"]: int(r["expired"]) for r in runs},
        oldest={r["key"]: r["oldest"] for r in runs},
        in_recovery=in_recovery,
    )


def in_recovery(reader: Reader) -> bool:
    return live(reader).in_recovery


def finished_by_status(reader: Reader, window_start: datetime) -> dict[str, int]:
    """Terminal runs finished since `window_start`, by status (the run_stats part query)."""
    rows = reader.rows(query("run_stats.runs"), {"window_start": window_start})
    return {str(r["key"]): int(r["n"]) for r in rows}


@dataclass(frozen=True, slots=True)
class Minute:
    start: datetime
    completed: int
    other: int


def per_minute(reader: Reader, now: datetime) -> list[Minute]:
    """60 minutes up to now's, each with its completed and otherwise finished runs."""
    rows = reader.rows(query("dashboard.per_minute"), {"now": now})
    last = now.replace(second=0, microsecond=0)
    minutes = [last - timedelta(minutes=59 - i) for i in range(60)]
    completed = {m: 0 for m in minutes}
    other = {m: 0 for m in minutes}
    for row in rows:
        minute = row["minute"]
        if minute in completed:
            target = completed if row["status"] == "completed" else other
            target[minute] += int(row["n"])
    return [Minute(m, completed[m], other[m]) for m in minutes]


def agents(reader: Reader, window_start: datetime) -> list[dict[str, Any]]:
    return reader.rows(query("dashboard.agents"), {"window_start": window_start, "top": TOP})


def workers(reader: Reader, window_start: datetime, top: int = WORKERS_TOP) -> list[dict[str, Any]]:
    params = {"window_start": window_start, "now": None, "top": top}
    return reader.rows(query("dashboard.workers"), params)


def tree(reader: Reader, run_id: str, limit: int) -> list[dict[str, Any]]:
    return reader.rows(query("dashboard.tree"), {"run_id": run_id, "limit": limit})


def children(reader: Reader, run_id: str) -> list[dict[str, Any]]:
    return reader.rows(query("dashboard.children"), {"run_id": run_id, "limit": CHILDREN + 1})
