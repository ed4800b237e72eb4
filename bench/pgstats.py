"""Server counters: HOT updates from pg_stat_user_tables, WAL position, flushed on demand."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import psycopg

TABLES: Final = ("agent_runs", "agent_run_attempts")


def flush_stats(conn: psycopg.Connection[Any]) -> None:
    """Make this backend publish its pending table counters (PostgreSQL 15+).

    pg_stat_force_next_flush() makes the flush that happens when the backend goes idle after
    this statement unconditional, so the counters are in shared memory once it returns.
    """
    conn.execute("SELECT pg_stat_force_next_flush()")


@dataclass(frozen=True)
class UpdateCounters:
    """Cumulative row-update counters of one table."""

    updates: int
    hot: int
    new_page: int | None  # PostgreSQL 16+: non-HOT updates that moved to another page

    def plus(self, other: UpdateCounters) -> UpdateCounters:
        new_page = (
            None
            if self.new_page is None or other.new_page is None
            else self.new_page + other.new_page
        )
        return UpdateCounters(self.updates + other.updates, self.hot + other.hot, new_page)

    def minus(self, other: UpdateCounters) -> UpdateCounters:
        new_page = (
            None
            if self.new_page is None or other.new_page is None
            else self.new_page - other.new_page
        )
        return UpdateCounters(self.updates - other.updates, self.hot - other.hot, new_page)

    @property
    def hot_ratio(self) -> float:
        return self.hot / self.updates if self.updates else 0.0


def update_counters(
    conn: psycopg.Connection[Any], tables: Sequence[str] = TABLES
) -> dict[str, UpdateCounters]:
    """Current counters of `tables` (names in public, or schema.name), the snapshot cleared
    first so they are fresh."""
    flush_stats(conn)
    conn.execute("SELECT pg_stat_clear_snapshot()")
    # n_tup_newpage_upd exists from PostgreSQL 16 on: read through to_jsonb, NULL before.
    rows = conn.execute(
        "SELECT CASE WHEN schemaname = 'public' THEN '' ELSE schemaname || '.' END || relname,"
        " n_tup_upd, n_tup_hot_upd, (to_jsonb(s) ->> 'n_tup_newpage_upd')::bigint"
        " FROM pg_stat_user_tables s"
    ).fetchall()
    found = {
        str(name): UpdateCounters(int(upd), int(hot), None if moved is None else int(moved))
        for name, upd, hot, moved in rows
        if name in tables
    }
    missing = set(tables) - set(found)
    if missing:
        raise RuntimeError(f"no statistics for {sorted(missing)}")
    return found


def wal_lsn(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def wal_bytes_since(conn: psycopg.Connection[Any], lsn: str) -> int:
    row = conn.execute(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)::bigint", (lsn,)
    ).fetchone()
    assert row is not None
    return int(row[0])
