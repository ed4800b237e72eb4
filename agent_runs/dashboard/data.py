"""The dashboard's reads: each request in one READ ONLY transaction with a statement timeout.

Listings, statistics and explanations come from the repository (`list_run_listings`,
`run_stats`, `list_run_attempts`, `explain_run`); the few queries only the pages need
(live counts, runs per minute, per agent, per worker identity, the sub-agent tree) are
sql/dashboard.*.sql files run here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Final, LiteralString

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool

from agent_runs.models import RunStatus
from agent_runs.repository import AgentRunRepository
from agent_runs.sql import query

# Rows shown per group on the overview and the workers page.
TOP: Final = 20
WORKERS_TOP: Final = 200
# Runs of a tree shown on the run page, and on the tree page behind its link.
TREE_ON_RUN_PAGE: Final = 50
TREE_PAGE: Final = 1000
# Levels a tree view reaches above the run (to find its top) and below that top.
TREE_LEVELS: Final = 100
CHILDREN: Final = 50
DAY_TOTALS_SECONDS: Final = 30.0
LIVE_SECONDS: Final = 5.0
# The statuses as the pages list them: live ones (pending, running, cancel_requested), then
# final ones (completed, failed, cancelled, interrupted).
LIVE_STATUSES: Final = tuple(s.value for s in RunStatus if not s.is_terminal)
FINAL_STATUSES: Final = tuple(s.value for s in RunStatus if s.is_terminal)


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
    """Non-terminal runs now: count, expired leases, runs scheduled for later and the oldest
    available run's creation per status."""

    counts: dict[str, int]
    expired: dict[str, int]
    oldest: dict[str, datetime]
    in_recovery: bool
    scheduled: int = 0  # pending runs not available yet (available_at in the future)


def live(reader: Reader) -> Live:
    rows = reader.rows(query("dashboard.live"), {"now": None})
    in_recovery = any(bool(r["in_recovery"]) for r in rows if r["key"] == "in_recovery")
    runs = [r for r in rows if r["key"] in LIVE_STATUSES]
    return Live(
        counts={s: next((int(r["n"]) for r in runs if r["key"] == s), 0) for s in LIVE_STATUSES},
        expired={r["key"]: int(r["expired"]) for r in runs},
        oldest={r["key"]: r["oldest"] for r in runs if r["oldest"] is not None},
        in_recovery=in_recovery,
        scheduled=sum(int(r["scheduled"]) for r in runs if r["key"] == "pending"),
    )


def in_recovery(reader: Reader) -> bool:
    """True on a hot standby (a replica in recovery): it can only be read."""
    with reader.conn.cursor() as cur:
        cur.execute("SELECT pg_is_in_recovery()", prepare=False)
        row = cur.fetchone()
    return bool(row and row[0])


@dataclass(frozen=True, slots=True)
class Minute:
    start: datetime
    completed: int
    other: int


@dataclass(frozen=True, slots=True)
class PerMinute:
    """The last 60 minutes (the current one included): runs finished in each, and in all by
    final status."""

    minutes: list[Minute]
    by_status: dict[str, int]


def per_minute(reader: Reader, now: datetime) -> PerMinute:
    rows = reader.rows(query("dashboard.per_minute"), {"now": now})
    last = now.replace(second=0, microsecond=0)
    minutes = [last - timedelta(minutes=59 - i) for i in range(60)]
    completed = {m: 0 for m in minutes}
    other = {m: 0 for m in minutes}
    by_status: dict[str, int] = {}
    for row in rows:
        minute, status, n = row["minute"], str(row["status"]), int(row["n"])
        if minute in completed:
            (completed if status == "completed" else other)[minute] += n
            by_status[status] = by_status.get(status, 0) + n
    return PerMinute([Minute(m, completed[m], other[m]) for m in minutes], by_status)


@dataclass(frozen=True, slots=True)
class Agents:
    """Runs finished in a window: by status in all, and per agent (the most failing first)."""

    by_status: dict[str, int]
    agents: list[dict[str, Any]]


class Cached:
    """The last day's totals, computed at most every DAY_TOTALS_SECONDS per app: they move
    slowly, cost a pass over a day of finished runs, and every open overview asks for them on
    each live refresh. Everything else on the pages is read fresh."""

    def __init__(self, seconds: float = DAY_TOTALS_SECONDS) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._value: tuple[float, datetime, Agents, dict[str, int]] | None = None
        self._live: tuple[float, Live] | None = None

    def live(self, reader: Reader) -> Live:
        """Live runs by status for the runs page's tabs: read at most every LIVE_SECONDS (a
        count over every live run; the overview reads its own fresh)."""
        with self._lock:
            value = self._live
        if value is not None and time.monotonic() < value[0]:
            return value[1]
        fresh = live(reader)
        with self._lock:
            self._live = (time.monotonic() + LIVE_SECONDS, fresh)
        return fresh

    def day(self, reader: Reader, now: datetime) -> tuple[Agents, datetime, dict[str, int]]:
        """The day's totals, the database time they were computed at, and the last hour's
        counts by status as of that same time (so that the two windows always agree)."""
        with self._lock:
            value = self._value
        if value is not None and time.monotonic() < value[0]:
            return value[2], value[1], value[3]
        fresh = agents(reader, now - timedelta(days=1))
        hour = per_minute(reader, now).by_status
        with self._lock:
            self._value = (time.monotonic() + self.seconds, now, fresh, hour)
        return fresh, now, hour


def agents(reader: Reader, window_start: datetime) -> Agents:
    rows = reader.rows(query("dashboard.agents"), {"window_start": window_start, "top": TOP})
    total = rows[0] if rows and rows[0]["agent"] is None else None
    statuses = ("completed", "failed", "interrupted", "cancelled")
    return Agents(
        by_status={s: int(total[s]) for s in statuses if total and total[s]},
        agents=[r for r in rows if r["agent"] is not None],
    )


def workers(reader: Reader, window_start: datetime, top: int = WORKERS_TOP) -> list[dict[str, Any]]:
    params = {"window_start": window_start, "now": None, "top": top}
    return reader.rows(query("dashboard.workers"), params)


@dataclass(frozen=True, slots=True)
class Tree:
    """A bounded view of a sub-agent tree, and where it is cut."""

    nodes: list[dict[str, Any]]  # parents before children, at most the view's limit
    more: bool  # the view holds more runs than its limit
    above: str | None  # the top's parent, when the view starts below the tree's root
    cut_below: list[dict[str, Any]]  # shown runs whose children are TREE_LEVELS below the top


def tree(reader: Reader, run_id: str, limit: int, *, from_run: bool = False) -> Tree:
    """The tree around `run_id`: from its root (or its ancestor TREE_LEVELS up), or with
    `from_run` from the run itself; TREE_LEVELS levels down from there."""
    params = {
        "run_id": run_id,
        "limit": limit + 1,
        "up": 0 if from_run else TREE_LEVELS,
        "down": TREE_LEVELS,
    }
    rows = reader.rows(query("dashboard.tree"), params)
    nodes = rows[:limit]
    top = nodes[0] if nodes else None
    return Tree(
        nodes=nodes,
        more=len(rows) > limit,
        above=str(top["parent"]) if top is not None and top["more_above"] else None,
        cut_below=[n for n in nodes if n["more_below"]],
    )


def finished_runs(
    reader: Reader,
    *,
    window_start: datetime,
    before: tuple[datetime, str] | None,
    filters: dict[str, Any],
    limit: int,
) -> list[dict[str, Any]]:
    """A page of the runs finished since window_start, the latest first (keyset `before`)."""
    return _page(
        reader,
        query("dashboard.finished_runs"),
        window_start=window_start,
        before=before,
        filters=filters,
        limit=limit,
    )


def runs_by_attempt(
    reader: Reader,
    *,
    window_start: datetime,
    before: tuple[datetime, str] | None,
    filters: dict[str, Any],
    limit: int,
) -> list[dict[str, Any]]:
    """A page of the runs with an attempt finished since window_start matching `filters`
    (outcome, error_type, worker), the latest matching attempt first (keyset `before`)."""
    return _page(
        reader,
        query("dashboard.runs_by_attempt"),
        window_start=window_start,
        before=before,
        filters=filters,
        limit=limit,
    )


def _page(
    reader: Reader,
    sql: LiteralString,
    *,
    window_start: datetime,
    before: tuple[datetime, str] | None,
    filters: dict[str, Any],
    limit: int,
) -> list[dict[str, Any]]:
    params = {
        "window_start": window_start,
        "before_at": before[0] if before else None,
        "before_id": before[1] if before else None,
        "limit": limit,
        **filters,
    }
    return reader.rows(sql, params)


def run_times(reader: Reader, run_ids: list[str]) -> dict[str, dict[str, Any]]:
    """started_at and finished_at of a page of runs (by primary key)."""
    if not run_ids:
        return {}
    rows = reader.rows(query("dashboard.run_times"), {"ids": run_ids})
    return {str(row["id"]): row for row in rows}


def find_runs(reader: Reader, prefix: str, limit: int) -> list[dict[str, Any]]:
    """Runs whose id starts with `prefix`, in id order."""
    return reader.rows(query("dashboard.find_runs"), {"prefix": prefix, "limit": limit})


def children(reader: Reader, run_id: str) -> list[dict[str, Any]]:
    return reader.rows(query("dashboard.children"), {"run_id": run_id, "limit": CHILDREN + 1})
