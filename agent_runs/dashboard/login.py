"""/login and /logout: a session cookie derived from the token (HttpOnly, SameSite=Strict); the
token itself is never put in a URL, a cookie or a log.

After a login the browser goes back to the page it asked for: `next`, or the page whose 401
linked to /login (its Referer, sent for same-origin links only); a path of this dashboard only,
never another origin. Failed attempts from one client are slowed: each answer waits
longer than the one before (up to a few seconds), so guessing the token costs time.
"""

from __future__ import annotations

import asyncio
import hmac
import threading
import time
from typing import Final
from urllib.parse import unquote, urlsplit

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from agent_runs.dashboard.common import settings
from agent_runs.dashboard.forms import read_form, same_origin
from agent_runs.dashboard.guard import SESSION_COOKIE, dashboard_root, session_value
from agent_runs.dashboard.render import error_page, page

# The delay after the n-th failure in a row: FIRST_DELAY * 2**(n-1), at most MAX_DELAY.
FIRST_DELAY: Final = 0.25
MAX_DELAY: Final = 4.0
# A client's failures are forgotten this long after its last one.
FORGET_SECONDS: Final = 15 * 60
_MAX_CLIENTS: Final = 10_000
_MAX_NEXT: Final = 2000


class Failures:
    """Failed logins per client address, for the delay of the next answer."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[int, float]] = {}

    def delay(self, client: str) -> float:
        with self._lock:
            count, last = self._seen.get(client, (0, 0.0))
        if not count or time.monotonic() - last > FORGET_SECONDS:
            return 0.0
        return float(min(MAX_DELAY, FIRST_DELAY * 2 ** (count - 1)))

    def failed(self, client: str) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._seen) >= _MAX_CLIENTS:
                self._seen = {k: v for k, v in self._seen.items() if now - v[1] < FORGET_SECONDS}
            count, last = self._seen.get(client, (0, 0.0))
            if now - last > FORGET_SECONDS:
                count = 0
            self._seen[client] = (count + 1, now)

    def succeeded(self, client: str) -> None:
        with self._lock:
            self._seen.pop(client, None)


def safe_next(value: str | None) -> str:
    """A path inside the dashboard to go back to, or "/" (never another origin: no scheme, no
    host, no `//` or backslash start, no control characters)."""
    if not value or len(value) > _MAX_NEXT or not value.startswith("/"):
        return "/"
    if value.startswith(("//", "/\\")) or not value.isprintable() or "\\" in value:
        return "/"
    return value


def _wanted(request: Request) -> str:
    """Where to go after the login: ?next=, else the same-origin page that linked here."""
    given = request.query_params.get("next")
    if given:
        return safe_next(given)
    referer = urlsplit(request.headers.get("referer", ""))
    own = urlsplit(str(request.url))
    root = dashboard_root(request.scope)
    if (referer.scheme, referer.netloc) != (own.scheme, own.netloc):
        return "/"
    if not referer.path.startswith(f"{root}/") or referer.path == f"{root}/login":
        return "/"
    inside = referer.path[len(root) :]
    return safe_next(f"{inside}?{referer.query}" if referer.query else inside)


def _client(request: Request) -> str:
    return request.client.host if request.client else "unknown"


def login_form(request: Request) -> Response:
    config = settings(request)
    wanted = _wanted(request)
    if config.token is None:
        return RedirectResponse(f"{dashboard_root(request.scope)}{wanted}", status_code=303)
    context = {"nav": "", "failed": False, "next": wanted}
    return page(config.env, request.scope, "login.html", context)


async def login(request: Request) -> Response:
    config = settings(request)
    root = dashboard_root(request.scope)
    if config.token is None:
        return RedirectResponse(f"{root}/", status_code=303)
    if not same_origin(request):
        return error_page(config.env, request, 403, "Refused", "log in from the dashboard's form")
    form = await read_form(request)
    wanted = safe_next(unquote(form.get("next", "")))  # percent-encoded in the form
    failures: Failures = request.app.state.login_failures
    client = _client(request)
    await asyncio.sleep(failures.delay(client))
    given = form.get("token", "")
    if not hmac.compare_digest(given.encode("utf-8", "replace"), config.token.encode()):
        failures.failed(client)
        context = {"nav": "", "failed": True, "next": wanted}
        return page(config.env, request.scope, "login.html", context, status=401)
    failures.succeeded(client)
    response = RedirectResponse(f"{root}{wanted}", status_code=303)
    response.set_cookie(
        SESSION_COOKIE,
        session_value(config.token),
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
        path=f"{root}/",
    )
    return response


async def logout(request: Request) -> Response:
    config = settings(request)
    if not same_origin(request):
        return error_page(config.env, request, 403, "Refused", "log out from the dashboard's form")
    root = dashboard_root(request.scope)
    response = RedirectResponse(f"{root}/login", status_code=303)
    response.delete_cookie(SESSION_COOKIE, path=f"{root}/", httponly=True, samesite="strict")
    return response
