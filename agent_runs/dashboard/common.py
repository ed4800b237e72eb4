"""What every page handler shares: the dashboard's settings, and errors turned into pages
(400 naming the parameter, 404, 503 for a slow query or an unreachable database)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, ParamSpec

import psycopg
from jinja2 import Environment
from psycopg import errors as pg_errors
from psycopg_pool import ConnectionPool, PoolTimeout
from starlette.requests import Request
from starlette.responses import Response

from agent_runs.dashboard.data import Cached
from agent_runs.dashboard.params import BadParameter
from agent_runs.dashboard.render import error_page
from agent_runs.errors import InvalidArgument

log = logging.getLogger("agent_runs.dashboard")

REPLICA_NOTE: Final = (
    "This database is a hot-standby replica (read only): cancelling is off here. "
    "Point a dashboard with --allow-cancel at the primary to cancel runs."
)


@dataclass(frozen=True, slots=True)
class Settings:
    pool: ConnectionPool
    allow_cancel: bool
    token: str | None
    statement_timeout_seconds: float
    secret: bytes
    env: Environment
    cache: Cached


class NotFound(Exception):
    """A run (or document) that does not exist: a 404 page."""


def settings(request: Request) -> Settings:
    value: Settings = request.app.state.dashboard
    return value


_P = ParamSpec("_P")


def guarded(handler: Callable[_P, Response]) -> Callable[_P, Response]:
    """Run `handler(request, ...)` (synchronous: Starlette runs it in its thread pool); its
    failures become pages."""

    @functools.wraps(handler)
    def wrapper(*args: _P.args, **kwargs: _P.kwargs) -> Response:
        request = args[0]
        assert isinstance(request, Request)
        env = settings(request).env
        try:
            return handler(*args, **kwargs)
        except BadParameter as exc:
            return error_page(env, request, 400, exc.title, exc.message)
        except InvalidArgument as exc:
            return error_page(env, request, 400, "Bad parameter", str(exc))
        except NotFound as exc:
            message = exc.args[0] if exc.args else "Not found"
            return error_page(env, request, 404, "Not found", message)
        except pg_errors.QueryCanceled:
            timeout = settings(request).statement_timeout_seconds
            message = (
                f"A query of this page ran longer than the statement timeout ({timeout:g} s) "
                "and was cancelled. Narrow the filters, or try again when the database is "
                "less busy."
            )
            return error_page(env, request, 503, "This page took too long", message)
        except pg_errors.ReadOnlySqlTransaction:
            return error_page(env, request, 503, "Read-only database", REPLICA_NOTE)
        except (PoolTimeout, psycopg.OperationalError) as exc:
            log.warning("dashboard: database unavailable: %s", type(exc).__name__)
            message = "The database did not answer. The page will work again once it does."
            return error_page(env, request, 503, "Database unavailable", message)

    return wrapper
