"""Connections: autocommit psycopg connections and pools, as the repository expects them."""

from __future__ import annotations

import inspect
import os
import re
import threading
import time
import weakref
from typing import Any, Final
from urllib.parse import quote

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import ConnectionPool

NO_PREPARE_ENV: Final = "AGENT_RUNS_NO_PREPARE"
_TRUE: Final = frozenset({"1", "true", "yes", "on"})

# ConnectionPool's own parameters; any other keyword given to create_pool is a connection option.
_POOL_PARAMETERS: Final = frozenset(inspect.signature(ConnectionPool.__init__).parameters) - {
    "self",
    "conninfo",
}


def connect(dsn: str, **kwargs: Any) -> psycopg.Connection[Any]:
    """A psycopg connection in autocommit mode; repository methods open their own transactions.

    Other keywords are psycopg connection options, e.g. `prepare_threshold=None` behind a
    transaction pooler (no named prepared statements at all).
    """
    kwargs.setdefault("autocommit", True)
    return psycopg.connect(dsn, **kwargs)


def _configure(conn: psycopg.Connection[Any]) -> None:
    conn.autocommit = True


# A connection given back to the pool this recently (healthy: the pool discards broken ones on
# return) is handed out again without the check's round trip. A busy pool then pays no extra
# round trip per call; one that died in between fails its call, and the caller retries.
RECENT_RETURN_SECONDS: Final = 2.0


class _RecentReturns:
    """When each connection last came back to the pool; the pool's `check` skips the round trip
    for one that came back within RECENT_RETURN_SECONDS."""

    def __init__(self) -> None:
        self._returned: weakref.WeakKeyDictionary[psycopg.Connection[Any], float] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def note(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            self._returned[conn] = time.monotonic()

    def check(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            returned = self._returned.pop(conn, None)
        if returned is None or time.monotonic() - returned >= RECENT_RETURN_SECONDS or conn.closed:
            ConnectionPool.check_connection(conn)


class _NotingPool(ConnectionPool[psycopg.Connection[Any]]):
    """A ConnectionPool that notes each return as it happens, in the returning thread. (A
    `reset` callback could note it too, but any `reset` makes psycopg_pool hand every return to
    its worker threads: a thread switch and about 40 µs of CPU per call.)"""

    def __init__(self, conninfo: str, *, returns: _RecentReturns, **kwargs: Any) -> None:
        self._returns = returns
        super().__init__(conninfo, **kwargs)

    def putconn(self, conn: psycopg.Connection[Any]) -> None:
        self._returns.note(conn)
        super().putconn(conn)


def connection_options(kwargs: dict[str, Any], pool_parameters: frozenset[str]) -> None:
    """Move the keywords a pool does not take into its `kwargs` (options of every connection)."""
    options = {k: kwargs.pop(k) for k in list(kwargs) if k not in pool_parameters}
    if options:
        kwargs["kwargs"] = {**(kwargs.get("kwargs") or {}), **options}


def create_pool(
    dsn: str, *, min_size: int = 1, max_size: int = 10, open: bool = True, **kwargs: Any
) -> ConnectionPool:
    """A psycopg_pool.ConnectionPool whose connections are autocommit and checked on checkout
    (with a round trip unless the connection came back to the pool within
    RECENT_RETURN_SECONDS; pass `check=ConnectionPool.check_connection` to always check).

    Keywords that ConnectionPool does not take are connection options, passed to every
    connection it opens (merged into its `kwargs`): `create_pool(dsn, prepare_threshold=None)`.
    """
    connection_options(kwargs, _POOL_PARAMETERS)
    kwargs.setdefault("configure", _configure)
    kwargs.update(min_size=min_size, max_size=max_size, open=open)
    if "check" not in kwargs:
        returns = _RecentReturns()
        return _NotingPool(dsn, returns=returns, check=returns.check, **kwargs)
    return ConnectionPool(dsn, **kwargs)


def no_prepare_from_env() -> bool:
    """AGENT_RUNS_NO_PREPARE=1 (or true/yes/on): use no named prepared statements."""
    return os.environ.get(NO_PREPARE_ENV, "").strip().lower() in _TRUE


_URL_PREFIXES: Final = ("postgresql+psycopg://", "postgresql://", "postgres://")
# user:password@ in a URL, up to its last "@" (hiding too much is the safe side).
_URL_PASSWORD: Final = re.compile(r"(://[^:@/?]*:)(.*)(@[^@]*)$", re.DOTALL)
_PASSWORD_WORD: Final = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|[^\s&]*)", re.I)


def redact(dsn: str) -> str:
    """The DSN (URL or key=value) with any password replaced by `***`, for messages and logs."""
    if dsn.startswith(_URL_PREFIXES):
        return _PASSWORD_WORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***\3", dsn))
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return _PASSWORD_WORD.sub(r"\1***", dsn)
    if params.get("password") is not None:
        params["password"] = "***"
    return make_conninfo("", **params)


def migration_url(dsn: str) -> str:
    """The `postgresql+psycopg://` URL yoyo needs for a URL or key=value DSN.

    Every option travels percent-encoded in the query string (yoyo hands them to psycopg as
    keywords), so passwords with `#`, `?`, `@`, `/`, `%` … arrive intact.
    """
    if dsn.startswith("postgresql+psycopg://"):
        dsn = "postgresql://" + dsn[len("postgresql+psycopg://") :]
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        raise ValueError(f"invalid DSN: libpq cannot parse {redact(dsn)!r}") from None
    query = "&".join(
        f"{quote(str(k), safe='')}={quote(str(v), safe='')}"
        for k, v in params.items()
        if v is not None
    )
    return f"postgresql+psycopg:///?{query}" if query else "postgresql+psycopg:///"
