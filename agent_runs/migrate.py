"""Schema migrations with yoyo-migrations, from the migrations/ folder shipped with the package.

Migrations never use named prepared statements, so they work through a transaction pooler.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any, Final

import psycopg
from yoyo import get_backend, read_migrations
from yoyo.exceptions import LockTimeout

from agent_runs.db import migration_url
from agent_runs.sql import migrations_dir

# How long a migrate waits for another one's lock before saying how to clear it.
LOCK_WAIT_SECONDS: Final = 10.0

CLEAR_LOCK_HINT: Final = (
    "If no migrate is running (a killed one left its lock behind), clear it with "
    "`DELETE FROM yoyo_lock;` in this database (or `yoyo break-lock`), then migrate again."
)


class MigrationLocked(RuntimeError):
    """Another migrate holds this database's migration lock, or a killed one left it."""


def yoyo_url(dsn: str) -> str:
    """The postgresql+psycopg:// URL yoyo needs, for a URL or a key=value DSN."""
    return migration_url(dsn)


@contextlib.contextmanager
def _backend(dsn: str) -> Iterator[Any]:
    backend = get_backend(yoyo_url(dsn))
    connection = backend.connection
    if isinstance(connection, psycopg.Connection):
        # No named prepared statements: psycopg's names would collide behind a pooler.
        connection.prepare_threshold = None
    locked = released = False
    try:
        with backend.lock(timeout=LOCK_WAIT_SECONDS):
            locked = True
            yield backend
        released = True
    except LockTimeout as exc:
        if locked:  # pragma: no cover - only taking the lock times out
            raise
        raise MigrationLocked(f"{exc}. {CLEAR_LOCK_HINT}") from None
    finally:
        with contextlib.suppress(psycopg.Error):
            connection.close()
        if locked and not released:
            _release_if_left(dsn, os.getpid())


def _release_if_left(dsn: str, pid: int) -> None:
    """Delete this process's lock row if it is still there (e.g. the connection broke before
    yoyo could release it), over a connection of its own."""
    if dsn.startswith("postgresql+psycopg://"):
        dsn = "postgresql://" + dsn[len("postgresql+psycopg://") :]
    with (
        contextlib.suppress(Exception),
        psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn,
    ):
        conn.execute("DELETE FROM yoyo_lock WHERE pid = %(pid)s", {"pid": pid})


def apply_migrations(dsn: str) -> list[str]:
    """Apply every pending migration; returns the ids applied (empty when up to date)."""
    with _backend(dsn) as backend:
        pending = backend.to_apply(read_migrations(str(migrations_dir())))
        backend.apply_migrations(pending)
        return [m.id for m in pending]


def rollback_migrations(dsn: str, *, count: int | None = 1) -> list[str]:
    """Roll back the last `count` applied migrations (None: all); returns the ids rolled back."""
    with _backend(dsn) as backend:
        applied = backend.to_rollback(read_migrations(str(migrations_dir())))
        chosen = applied if count is None else applied[:count]
        backend.rollback_migrations(chosen)
        return [m.id for m in chosen]
