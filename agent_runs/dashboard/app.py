"""create_app: the dashboard as an ASGI app, to serve alone or mount under any prefix."""

from __future__ import annotations

import math
import secrets
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from psycopg_pool import ConnectionPool
from starlette.applications import Starlette
from starlette.convertors import Convertor, register_url_convertor
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Scope

from agent_runs import validation as check
from agent_runs.dashboard import actions, keys_page, login, pages, run_page, runs_page
from agent_runs.dashboard.common import Settings
from agent_runs.dashboard.data import Cached
from agent_runs.dashboard.guard import Guard
from agent_runs.dashboard.hosts import HostAllowList
from agent_runs.dashboard.render import DOT_IDS, DOT_MARK, error_page, make_environment
from agent_runs.errors import InvalidArgument


class _RunIdConvertor(Convertor[str]):
    """A run id in the path: any text, line breaks included (`path`'s `.*` stops at one);
    an id of only dots comes with DOT_MARK after it."""

    regex = r"[\s\S]*"

    def convert(self, value: str) -> str:
        if value.endswith(DOT_MARK) and value[: -len(DOT_MARK)] in DOT_IDS:
            return value[: -len(DOT_MARK)]  # "..": see render.run_segment
        return value

    def to_string(self, value: str) -> str:
        return value


register_url_convertor("agent_runs_run_id", _RunIdConvertor())

STATIC_DIR: Final = Path(__file__).resolve().parent / "static"
_TITLES: Final = {
    400: "Bad request",
    401: "Log in",
    403: "Forbidden",
    404: "Not found",
    405: "Method not allowed",
    500: "Internal error",
}


def _favicon(request: Request) -> Response:
    return FileResponse(STATIC_DIR / "favicon.svg", media_type="image/svg+xml")


def create_app(
    pool: ConnectionPool,
    *,
    allow_cancel: bool = False,
    token: str | None = None,
    statement_timeout_seconds: float = 5.0,
    allowed_hosts: Iterable[str] | None = None,
) -> ASGIApp:
    """The dashboard over `pool` (a psycopg_pool.ConnectionPool, e.g. agent_runs.create_pool).

    allow_cancel: offer cancel and cancel-tree on the run page (never on a hot standby).
    token: every request then needs `Authorization: Bearer <token>` or the cookie that /login
    sets. statement_timeout_seconds: each request's queries are cancelled after this long (503).
    allowed_hosts: the names (`host`, `host:port`, `[v6]:port`) a request's Host header may
    give; any other is a 400 before any other work (this defeats DNS rebinding). None, the
    default, checks no Host: for an app mounted in another, whose server checks it (Starlette's
    TrustedHostMiddleware); `agent-runs dashboard` always passes its list.
    """
    check.flag("allow_cancel", allow_cancel)
    check.dashboard_token(token)
    if (
        isinstance(statement_timeout_seconds, bool)
        or not isinstance(statement_timeout_seconds, int | float)
        or not math.isfinite(statement_timeout_seconds)
        or not 0.001 <= statement_timeout_seconds <= 3600
    ):
        raise InvalidArgument("statement_timeout_seconds must be a number from 0.001 to 3600")
    hosts = None if allowed_hosts is None else HostAllowList(allowed_hosts)
    env = make_environment()
    routes: list[BaseRoute] = [
        Route("/", pages.overview, name="overview"),
        Route("/runs", runs_page.runs, name="runs"),
        Route("/find", runs_page.find, name="find"),
        Route("/runs/{run_id:agent_runs_run_id}", run_page.run_page, name="run"),
        Route("/tree/{run_id:agent_runs_run_id}", run_page.tree_page, name="tree"),
        Route("/json/{kind}/{run_id:agent_runs_run_id}", run_page.document, name="document"),
        Route("/workers", pages.workers, name="workers"),
        Route("/keys", keys_page.keys, name="keys"),
        Route("/healthz", pages.healthz, name="healthz"),
        # Browsers ask for /favicon.ico on pages that name no icon (the JSON views): a 404
        # there is a console error.
        Route("/favicon.ico", _favicon),
        Route("/login", login.login_form, methods=["GET"]),
        Route("/login", login.login, methods=["POST"]),
        Route("/logout", login.logout, methods=["POST"]),
        Route("/done/{action}", actions.result, methods=["GET"]),
        Mount("/static", app=StaticFiles(directory=STATIC_DIR), name="static"),
    ]
    for name, action in actions.ACTIONS.items():
        path = f"/{name}/{{run_id:agent_runs_run_id}}"
        routes.append(Route(path, actions.confirmer(name), methods=["GET"]))
        routes.append(Route(path, actions.performer(name), methods=["POST"]))
        if action.bulk:
            routes.append(Route(f"/selected/{name}", actions.bulk_confirmer(name)))
            routes.append(
                Route(f"/selected/{name}", actions.bulk_performer(name), methods=["POST"])
            )

    async def http_error(request: Request, exc: Exception) -> Response:
        status = int(getattr(exc, "status_code", 500))
        detail = str(getattr(exc, "detail", "") or _TITLES.get(status, "Error"))
        headers = getattr(exc, "headers", None) or {}
        response = error_page(env, request, status, _TITLES.get(status, "Error"), detail)
        response.headers.update(headers)
        return response

    async def server_error(request: Request, exc: Exception) -> Response:
        message = "The dashboard failed on this request; the details are in its log."
        return error_page(env, request, 500, "Internal error", message)

    app = Starlette(
        routes=routes,
        exception_handlers={404: http_error, 405: http_error, 400: http_error, 500: server_error},
    )
    app.state.dashboard = Settings(
        pool=pool,
        allow_cancel=allow_cancel,
        token=token,
        statement_timeout_seconds=float(statement_timeout_seconds),
        secret=secrets.token_bytes(32),
        env=env,
        cache=Cached(),
    )
    app.state.login_failures = login.Failures()

    async def refuse(scope: Scope, status: int, message: str) -> tuple[bytes, str]:
        title = _TITLES.get(status, "Refused")
        response = error_page(env, {**scope, "app": app}, status, title, message)
        return bytes(response.body), "text/html; charset=utf-8"

    return Guard(app, token=token, refuse=refuse, allowed_hosts=hosts)
