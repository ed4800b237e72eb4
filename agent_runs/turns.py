"""Threads sharing a connection take turns: one repository call at a time, from first to last
statement."""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from types import FunctionType
from typing import Any, ParamSpec, TypeVar

import psycopg

_P = ParamSpec("_P")
_T = TypeVar("_T")

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


def _taking_turns(method: Callable[_P, _T]) -> Callable[_P, _T]:
    @functools.wraps(method)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        with turns(args[0].conn):  # type: ignore[attr-defined]
            return method(*args, **kwargs)

    return call


def one_call_at_a_time(cls: type[Any]) -> None:
    """Wrap every public method of `cls` (its bases' too) in its connection's turn."""
    for name in dir(cls):
        method = getattr(cls, name)
        if not name.startswith("_") and isinstance(method, FunctionType):
            setattr(cls, name, _taking_turns(method))
