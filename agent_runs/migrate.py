"""Schema migrations with yoyo-migrations, from the migrations/ folder shipped with the package."""

from __future__ import annotations

from yoyo import get_backend, read_migrations

from agent_runs.sql import migrations_dir


def yoyo_url(dsn: str) -> str:
    """yoyo 9 picks psycopg2 for postgresql:// URLs; force the psycopg 3 driver."""
    for prefix in ("postgresql+psycopg://", "postgresql://", "postgres://"):
        if dsn.startswith(prefix):
            return "postgresql+psycopg://" + dsn[len(prefix) :]
    if "=" in dsn:  # a libpq key=value string: not a URL yoyo can read
        raise ValueError("migrations need a postgresql:// URL, not a key=value DSN")
    return dsn


def apply_migrations(dsn: str) -> list[str]:
    """Apply every pending migration; returns the ids applied (empty when up to date)."""
    backend = get_backend(yoyo_url(dsn))
    migrations = read_migrations(str(migrations_dir()))
    with backend.lock():
        pending = backend.to_apply(migrations)
        backend.apply_migrations(pending)
    return [m.id for m in pending]


def rollback_migrations(dsn: str, *, count: int = 1) -> list[str]:
    """Roll back the last `count` applied migrations; returns the ids rolled back."""
    backend = get_backend(yoyo_url(dsn))
    migrations = read_migrations(str(migrations_dir()))
    with backend.lock():
        applied = backend.to_rollback(migrations)
        chosen = applied[:count]
        backend.rollback_migrations(chosen)
    return [m.id for m in chosen]
