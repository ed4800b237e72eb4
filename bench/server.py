"""The benchmark's PostgreSQL: an embedded server, or AGENT_RUNS_BENCH_DSN; fresh databases."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import psycopg
from psycopg import sql

from agent_runs.migrate import apply_migrations


@dataclass
class BenchServer:
    """A server to create throwaway databases on; every database made here is dropped after."""

    kind: str  # "embedded" | "dsn"
    admin_url: str
    version: str = ""
    _created: list[str] = field(default_factory=list)
    _prefix: str = field(default_factory=lambda: f"agent_runs_bench_{secrets.token_hex(3)}")

    def url_for(self, database: str) -> str:
        parts = urlsplit(self.admin_url)
        return urlunsplit(parts._replace(path="/" + quote(database, safe="")))

    def admin(self) -> psycopg.Connection[Any]:
        return psycopg.connect(self.admin_url, autocommit=True)

    def fresh_database(self, label: str) -> str:
        """CREATE a new empty database, apply the migrations, return its URL."""
        name = f"{self._prefix}_{label}"
        with self.admin() as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        self._created.append(name)
        url = self.url_for(name)
        apply_migrations(url)
        return url

    def drop(self, url: str) -> None:
        """DROP one database made here (by its URL): what comes next runs on a quiet server,
        not beside this one's history and the autovacuum it still owes."""
        name = unquote(urlsplit(url).path.lstrip("/"))
        with self.admin() as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
        if name in self._created:
            self._created.remove(name)

    def drop_all(self) -> None:
        with self.admin() as conn:
            for name in reversed(self._created):
                conn.execute(
                    sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
                )
        self._created.clear()


@contextlib.contextmanager
def bench_server(dsn: str | None) -> Iterator[BenchServer]:
    """Use the server at `dsn` (a postgresql:// URL), or start an embedded one; clean up after."""
    with contextlib.ExitStack() as stack:
        if dsn:
            if not dsn.startswith(("postgresql://", "postgres://")):
                raise SystemExit("AGENT_RUNS_BENCH_DSN must be a postgresql:// URL")
            server = BenchServer(kind="dsn", admin_url=dsn)
        else:
            from agent_runs.devtools.embedded import embedded_postgres

            embedded = stack.enter_context(embedded_postgres(prefix="agent_runs-bench-pg-"))
            server = BenchServer(kind="embedded", admin_url=embedded.url)
        with server.admin() as conn:
            row = conn.execute("SHOW server_version").fetchone()
            server.version = str(row[0]) if row else "?"
        try:
            yield server
        finally:
            server.drop_all()
