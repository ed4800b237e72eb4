"""The ASGI layer around the dashboard's routes: the Host allow-list (first, before any other
work), security headers on every response, the method rule (read only), token auth, and a
last-resort 500 page that never shows a traceback.

It wraps the Starlette app from the outside, so that even Starlette's own error responses and
the static files carry the headers.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agent_runs.dashboard.hosts import HostAllowList

log = logging.getLogger("agent_runs.dashboard")

SECURITY_HEADERS: Final = (
    (b"content-security-policy", b"default-src 'self'; frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),
    (b"x-frame-options", b"DENY"),
)
SESSION_COOKIE: Final = "agent_runs_session"
# Reached without a token: the login form, and the icon, style sheet and script it uses.
_OPEN_PATHS: Final = frozenset({"/login", "/favicon.ico"})
_OPEN_PREFIX: Final = "/static/"
# Methods with side effects are refused everywhere, except POST (login, cancel: the routes
# that take it check their own rules; every other route answers POST with 405).
_SAFE_METHODS: Final = frozenset({"GET", "HEAD"})
_FALLBACK_PAGE: Final = (
    b"<!doctype html><title>Internal error</title><h1>Internal error</h1>"
    b"<p>The dashboard failed on this request; the details are in its log.</p>"
)

_WRONG_HOST: Final = (
    b"400 Bad request: this dashboard does not answer to the Host this request names. "
    b"Open it by the address it printed at start, or start it with --allowed-host NAME.\n"
)


# The scope key where the Guard keeps the dashboard's own mount point: Starlette's inner
# mounts (/static) extend root_path, and links must still start at the dashboard's root.
ROOT_KEY: Final = "agent_runs.dashboard_root"


def dashboard_root(scope: Scope) -> str:
    """The prefix the dashboard is mounted under ("" when served alone)."""
    root: str = scope.get(ROOT_KEY, scope.get("root_path", ""))
    return root


def route_path(scope: Scope) -> str:
    """The path inside the dashboard, whatever prefix it is mounted under."""
    path: str = scope.get("path", "")
    root = dashboard_root(scope)
    if root and path.startswith(root) and path[len(root) : len(root) + 1] in ("", "/"):
        return path[len(root) :] or "/"
    return path


def session_value(token: str) -> str:
    """The cookie's value: derived from the token, so the browser never stores the token."""
    return hmac.new(token.encode(), b"agent_runs dashboard session", hashlib.sha256).hexdigest()


def authorized(headers: dict[bytes, bytes], token: str) -> bool:
    """Bearer header or session cookie, both compared in constant time."""
    given = headers.get(b"authorization", b"")
    scheme, _, credential = given.partition(b" ")
    if scheme.lower() == b"bearer" and hmac.compare_digest(
        credential.strip(), token.encode("utf-8")
    ):
        return True
    for part in headers.get(b"cookie", b"").split(b";"):
        name, _, value = part.strip().partition(b"=")
        if name == SESSION_COOKIE.encode() and hmac.compare_digest(
            value, session_value(token).encode()
        ):
            return True
    return False


class Guard:
    """The outermost layer of the dashboard's ASGI app."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str | None,
        refuse: Callable[[Scope, int, str], Awaitable[tuple[bytes, str]]] | None = None,
        allowed_hosts: HostAllowList | None = None,
    ) -> None:
        self.app = app
        self.token = token
        self.refuse = refuse
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope = {**scope, ROOT_KEY: scope.get("root_path", "")}
        started = False

        async def send_secured(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                names = {name for name, _ in SECURITY_HEADERS}
                headers = [h for h in message.get("headers", []) if h[0].lower() not in names]
                message = {**message, "headers": [*headers, *SECURITY_HEADERS]}
            await send(message)

        method = scope.get("method", "GET")
        path = route_path(scope)
        try:
            headers = dict(scope.get("headers", []))
            if self.allowed_hosts is not None and not self.allowed_hosts.allows(
                headers.get(b"host"), str(scope.get("scheme", "http"))
            ):
                # Plain text: nothing of the request is echoed, no template is rendered.
                await _respond(send_secured, 400, _WRONG_HOST, "text/plain; charset=utf-8")
                return
            if method not in _SAFE_METHODS and method != "POST":
                await self._refused(scope, send_secured, 405, f"{method} is not allowed here")
                return
            if (
                self.token is not None
                and path not in _OPEN_PATHS
                and not path.startswith(_OPEN_PREFIX)
                and not authorized(headers, self.token)
            ):
                await self._refused(scope, send_secured, 401, "log in to see this page")
                return
            await self.app(scope, receive, send_secured)
        except Exception:
            log.exception("dashboard: %s %s failed", method, path)
            if not started:
                await _respond(send_secured, 500, _FALLBACK_PAGE, "text/html; charset=utf-8")

    async def _refused(self, scope: Scope, send: Send, status: int, message: str) -> None:
        body, content_type = (message.encode(), "text/plain; charset=utf-8")
        if self.refuse is not None:
            body, content_type = await self.refuse(scope, status, message)
        extra: list[tuple[bytes, bytes]] = []
        if status == 405:
            extra.append((b"allow", b"GET, HEAD, POST"))
        if status == 401:
            extra.append((b"www-authenticate", b'Bearer realm="agent_runs dashboard"'))
        await _respond(send, status, body, content_type, extra)


async def _respond(
    send: Send,
    status: int,
    body: bytes,
    content_type: str,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> None:
    headers: list[Any] = [
        (b"content-type", content_type.encode()),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
        *(extra or []),
    ]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
