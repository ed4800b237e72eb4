"""Connections: autocommit psycopg connections and pools, as the repository expects them."""

from __future__ import annotations

import os
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """A psycopg connection in autocommit mode; repository methods open their own transactions."""
    kwargs.setdefault("autocommit", True)
    return psycopg.connect(dsn, **kwargs)


def _configure(conn: psycopg.Connection[Any]) -> None:
    conn.autocommit = True


def create_pool(
    dsn: str, *, min_size: int = 1, max_size: int = 10, open: bool = True, **kwargs: Any
) -> ConnectionPool:
    """A psycopg_pool.ConnectionPool whose connections are autocommit and checked on checkout."""
    kwargs.setdefault("configure", _configure)
    kwargs.setdefault("check", ConnectionPool.check_connection)
    return ConnectionPool(dsn, min_size=min_size, max_size=max_size, open=open, **kwargs)


def no_prepare_from_env() -> bool:
    """AGENT_RUNS_NO_PREPARE=1 (or true/yes/on): use no named prepared statements."""
    return os.environ.get("AGENT_RUNS_NO_PREPARE", "").strip().lower() in {"1", "true", "yes", "on"}
