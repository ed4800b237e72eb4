"""Threads sharing a connection take turns: one repository call at a time, from first to last
statement (agent_runs.driver holds the turn while it carries a call's plan out)."""

from __future__ import annotations

import threading
import weakref
from typing import Any

import psycopg

# One re-entrant lock per connection, shared by every repository on it: a public call holds it
# from its first statement to its last, so threads sharing a connection take turns call by call
# (psycopg's own conn.lock is per statement, and not re-entrant).
_turns: weakref.WeakKeyDictionary[psycopg.Connection[Any], threading.RLock] = (
    weakref.WeakKeyDictionary()
)
_turns_made = threading.Lock()


def turns(conn: psycopg.Connection[Any]) -> threading.RLock:
    """The lock every repository call on `conn` holds for its whole duration."""
    lock = _turns.get(conn)
    if lock is None:
        with _turns_made:
            lock = _turns.setdefault(conn, threading.RLock())
    return lock
