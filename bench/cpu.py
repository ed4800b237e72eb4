"""CPU time of the server's backends and of local processes, from /proc/<pid>/stat.

A backend's file is read locally when the server runs on this machine (the embedded one), else
through pg_read_file when the server shares this kernel and lets us; otherwise there is no
reading (None) and the caller says so.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import psycopg

TICKS_PER_SECOND: Final = os.sysconf("SC_CLK_TCK")


def backend_ticks(conn: psycopg.Connection[Any], pids: Sequence[int]) -> int | None:
    """utime + stime (clock ticks) summed over the backends, or None when one is not readable."""
    readings = _ticks_by_pid(conn, pids)
    return None if readings is None else sum(readings.values())


def backend_pid_ticks(conn: psycopg.Connection[Any], pid: int) -> int | None:
    """utime + stime (clock ticks) of one backend, or None when not readable."""
    text = _stat(pid)
    if text is None:
        try:
            row = conn.execute("SELECT pg_read_file(%s)", (f"/proc/{pid}/stat",)).fetchone()
        except psycopg.Error:
            return None
        text = str(row[0]) if row else None
    if text is None or "(postgres)" not in text:
        return None
    return _ticks(text)


def database_backend_ticks(conn: psycopg.Connection[Any]) -> dict[int, int] | None:
    """Clock ticks of every other client backend of `conn`'s database, by PID; None when one is
    not readable."""
    rows = conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
        " AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
    ).fetchall()
    return _ticks_by_pid(conn, [int(pid) for (pid,) in rows])


def _ticks_by_pid(conn: psycopg.Connection[Any], pids: Sequence[int]) -> dict[int, int] | None:
    readings: dict[int, int] = {}
    for pid in pids:
        ticks = backend_pid_ticks(conn, pid)
        if ticks is None:
            return None
        readings[pid] = ticks
    return readings


def process_ticks(pid: int) -> int | None:
    """utime + stime (clock ticks) of a local process (all its threads), or None once gone."""
    text = _stat(pid)
    return None if text is None else _ticks(text)


def _stat(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None


def _ticks(stat: str) -> int:
    fields = stat.rpartition(")")[2].split()
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
