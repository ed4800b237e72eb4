"""Schema migrations with yoyo-migrations, from the migrations/ folder shipped with the package."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from yoyo import get_backend, read_migrations

from agent_runs.sql import migrations_dir


def yoyo_url(dsn: str) -> str:
    """yoyo 9 picks psycopg2 for postgresql:// URLs; force the psycopg 3 driver."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if dsn.startswith(prefix):
            return "postgresql+psycopg://" + dsn[len(prefix) :]
    raise ValueError("migrations need a postgresql:// URL (yoyo cannot read key=value DSNs)")


@contextlib.contextmanager
def _backend(dsn: str) -> Iterator[Any]:
    backend = get_backend(yoyo_url(dsn))
    try:
        with backend.lock():
            yield backend
    finally:
        backend.connection.close()


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
