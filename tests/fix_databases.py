"""Databases for tests (a pytest plugin): one migrated template per session, a clone per test,
and the connections a test works with (`dsn`, `blank_dsn`, `conn`, `observer`, `repo`)."""

from __future__ import annotations

import itertools
import secrets
import time
from collections.abc import Iterator
from typing import Any, Final

import psycopg
import pytest
from psycopg import sql

import agent_runs
from agent_runs import AgentRunRepository
from agent_runs.migrate import apply_migrations
from tests.fix_server import PgServer

# Everything a test could change in a clone besides the rows of the two tables: if any of it
# differs from the template after a test, the clone is dropped instead of recycled.
_FINGERPRINT_SQL: Final = """
SELECT md5(string_agg(item, E'\n' ORDER BY item)) FROM (
    SELECT format('rel %s %s %s %s', n.nspname, c.relname, c.relkind, c.reloptions) AS item
    FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
    WHERE n.nspname NOT IN ('pg_catalog', 'information_schema', 'pg_toast')
      AND n.nspname NOT LIKE 'pg_temp%' AND n.nspname NOT LIKE 'pg_toast_temp%'
    UNION ALL
    SELECT format('col %s %s %s %s %s', a.attrelid::regclass, a.attname,
                  format_type(a.atttypid, a.atttypmod), a.attnotnull,
                  pg_get_expr(d.adbin, d.adrelid))
    FROM pg_attribute a
    JOIN pg_class c ON c.oid = a.attrelid
    JOIN pg_namespace n ON n.oid = c.relnamespace
    LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
    WHERE n.nspname = 'public' AND a.attnum > 0 AND NOT a.attisdropped
    UNION ALL
    SELECT format('con %s %s %s', conrelid::regclass, conname, pg_get_constraintdef(oid))
    FROM pg_constraint WHERE connamespace = 'public'::regnamespace
    UNION ALL
    SELECT format('trg %s %s', pg_get_triggerdef(oid), tgenabled)
    FROM pg_trigger WHERE NOT tgisinternal
    UNION ALL
    SELECT format('fn %s %s', p.oid::regprocedure, md5(p.prosrc))
    FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace
    UNION ALL
    SELECT format('ns %s', nspname) FROM pg_namespace
    UNION ALL
    SELECT format('ext %s %s', extname, extversion) FROM pg_extension
    UNION ALL
    SELECT format('set %s %s', setrole, setconfig) FROM pg_db_role_setting
    WHERE setdatabase = (SELECT oid FROM pg_database WHERE datname = current_database())
    UNION ALL
    SELECT format('stats %s', count(*)) FROM pg_stats
    WHERE schemaname = 'public' AND tablename IN ('agent_runs', 'agent_run_attempts')
    UNION ALL
    SELECT format('yoyo %s %s', migration_hash, migration_id) FROM _yoyo_migration
    UNION ALL
    SELECT format('yoyo-log %s', count(*)) FROM _yoyo_log
    UNION ALL
    SELECT format('yoyo-lock %s', count(*)) FROM yoyo_lock
) AS catalog
"""


class _Databases:
    """The session's databases: a migrated template, its clones, and empty ones.

    Cloning a template copies the whole database (system catalogs included), which is slow on
    a busy disk. A clone a test has finished with is therefore recycled when it can be proven
    pristine again: its connections are cut, the tables truncated, its catalog compared
    with the template's, and it is renamed, so the finished test's URL stops working. Anything
    unexpected (a changed schema, a setting, statistics, a session that will not leave) and
    the clone is dropped instead. Every test still gets a migrated, empty database of its own.
    """

    def __init__(self, server: PgServer) -> None:
        self.server = server
        # A random suffix: parallel sessions on one server never collide.
        self.prefix = f"agent_runs_test_{secrets.token_hex(4)}"
        self.template = f"{self.prefix}_tpl"
        self._counter = itertools.count(1)
        self._admin = psycopg.connect(server.admin_url, autocommit=True)
        self._admin.execute("SET synchronous_commit = off")  # only throwaway databases change
        self._spare: list[str] = []
        self._template_fingerprint = ""

    def new_name(self) -> str:
        return f"{self.prefix}_{next(self._counter)}"

    def create(self, name: str, *, template: str = "template0") -> str:
        self._admin.execute(
            sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(
                sql.Identifier(name), sql.Identifier(template)
            )
        )
        return self.server.url_for(name)

    def drop(self, name: str) -> None:
        self._admin.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )

    def create_template(self) -> None:
        apply_migrations(self.create(self.template))
        self._template_fingerprint = self._fingerprint(self.template)

    def _fingerprint(self, name: str) -> str:
        with psycopg.connect(self.server.url_for(name), autocommit=True) as conn:
            row = conn.execute(_FINGERPRINT_SQL).fetchone()
        assert row is not None
        return str(row[0])

    def take_clone(self) -> str:
        """A migrated, empty database no other test is using."""
        if self._spare:
            return self._spare.pop()
        name = self.new_name()
        self.create(name, template=self.template)
        return name

    def give_back(self, name: str) -> None:
        """Recycle a clone a test has finished with (renamed: its old URL stops working)."""
        fresh = self.new_name()
        try:
            self._evict(name)
            self._admin.execute(
                sql.SQL("ALTER DATABASE {} RENAME TO {}").format(
                    sql.Identifier(name), sql.Identifier(fresh)
                )
            )
        except psycopg.Error:
            self.drop(name)
            return
        try:
            if self._reset(fresh):
                self._spare.append(fresh)
                return
        except psycopg.Error:
            pass
        self.drop(fresh)

    def _evict(self, name: str, *, timeout: float = 5.0) -> None:
        """Cut every session of a database and wait until they are gone."""
        deadline = time.monotonic() + timeout
        while True:
            row = self._admin.execute(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE datname = %s AND pid <> pg_backend_pid()",
                (name,),
            ).fetchone()
            if not row or not row[0] or time.monotonic() > deadline:
                return
            time.sleep(0.002)

    def _reset(self, name: str) -> bool:
        """Truncate a clone nobody else can reach; False when it no longer matches the template."""
        with psycopg.connect(self.server.url_for(name), autocommit=True) as conn:
            conn.execute("SET lock_timeout = '5s'")
            conn.execute("SET synchronous_commit = off")  # throwaway data: no fsync to wait for
            row = conn.execute(_FINGERPRINT_SQL).fetchone()
            if row is None or row[0] != self._template_fingerprint:
                return False
            touched = conn.execute(
                "SELECT EXISTS (SELECT FROM agent_runs) OR EXISTS (SELECT FROM agent_run_attempts)"
                " OR EXISTS (SELECT FROM agent_run_waiters)"
                " OR EXISTS (SELECT FROM agent_run_limits)"
                " OR (SELECT is_called FROM agent_run_attempts_id_seq)"
            ).fetchone()
            if touched is None or touched[0]:
                conn.execute(
                    "TRUNCATE agent_runs, agent_run_attempts, agent_run_waiters, agent_run_limits"
                    " RESTART IDENTITY"
                )
        return True

    def close(self) -> None:
        try:
            for name in [*self._spare, self.template]:
                self.drop(name)
        finally:
            self._admin.close()


@pytest.fixture(scope="session")
def _databases(pg_server: PgServer) -> Iterator[_Databases]:
    """The session's migrated template database; it and every clone are dropped at the end."""
    databases = _Databases(pg_server)
    try:
        databases.create_template()
        yield databases
    finally:
        databases.close()


@pytest.fixture
def dsn(_databases: _Databases) -> Iterator[str]:
    """URL of a fresh, migrated, empty database for this test; unusable after the test."""
    name = _databases.take_clone()
    try:
        yield _databases.server.url_for(name)
    finally:
        _databases.give_back(name)


@pytest.fixture
def blank_dsn(_databases: _Databases) -> Iterator[str]:
    """URL of a fresh, empty database (no migrations applied), dropped after."""
    name = _databases.new_name()
    url = _databases.create(name)
    try:
        yield url
    finally:
        _databases.drop(name)


@pytest.fixture
def conn(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """The connection under test: `agent_runs.connect(dsn)` (autocommit)."""
    with agent_runs.connect(dsn) as connection:
        yield connection


@pytest.fixture
def observer(dsn: str) -> Iterator[psycopg.Connection[Any]]:
    """A second autocommit connection to the test's database, to read state and prove locks."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection


@pytest.fixture
def repo(conn: psycopg.Connection[Any]) -> AgentRunRepository:
    return AgentRunRepository(conn)
