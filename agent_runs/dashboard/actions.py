"""The dashboard's only writes and its login: POST after a confirmation page, with a CSRF
token and the request's Origin checked to be the dashboard's own.

Cancel and cancel-tree exist only with allow_cancel, never on a hot-standby replica, and follow
`request_cancel` / `request_cancel_tree`'s rules. Login sets a session cookie derived from the
token (HttpOnly, SameSite=Strict); the token itself is never put in a URL, a cookie or a log.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Final
from urllib.parse import parse_qs

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from agent_runs.dashboard import data
from agent_runs.dashboard.common import REPLICA_NOTE, guarded, settings
from agent_runs.dashboard.guard import SESSION_COOKIE, dashboard_root, session_value
from agent_runs.dashboard.params import only
from agent_runs.dashboard.render import error_page, page
from agent_runs.dashboard.run_page import _found, _run_id
from agent_runs.errors import InvalidArgument, ThreadBusy
from agent_runs.models import AgentRun

CSRF_SECONDS: Final = 15 * 60
_MAX_FORM_BYTES: Final = 8192
ACTIONS: Final = ("cancel", "cancel-tree", "requeue")


def csrf_token(secret: bytes, action: str, run_id: str, issued: int | None = None) -> str:
    issued = int(time.time()) if issued is None else issued
    mac = hmac.new(secret, f"{action}\0{run_id}\0{issued}".encode(), hashlib.sha256).hexdigest()
    return f"{issued}.{mac}"


def _csrf_valid(secret: bytes, action: str, run_id: str, token: str) -> bool:
    issued_text, _, _mac = token.partition(".")
    if not (issued_text.isascii() and issued_text.isdigit()) or len(issued_text) > 12:
        return False
    issued = int(issued_text)
    if not 0 <= time.time() - issued <= CSRF_SECONDS:
        return False
    expected = csrf_token(secret, action, run_id, issued)
    return hmac.compare_digest(expected.encode(), token.encode("utf-8", "replace"))


def same_origin(request: Request) -> bool:
    """The browser's Origin header names this dashboard (scheme, host and port)."""
    origin = request.headers.get("origin")
    if not origin:
        return False
    own = f"{request.url.scheme}://{request.url.netloc}"
    return hmac.compare_digest(origin.encode("utf-8", "replace"), own.encode())


async def _form(request: Request) -> dict[str, str]:
    """A small urlencoded form body (no multipart, no files)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > _MAX_FORM_BYTES:
            return {}
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {k: v[0] for k, v in fields.items() if v}


def confirmer(action: str) -> Callable[[Request], Response]:
    """GET /{action}/{run_id}: the confirmation page (a page, not a script dialog)."""

    @guarded
    def confirm(request: Request) -> Response:
        return _confirm(request, action)

    return confirm


def performer(action: str) -> Callable[[Request], Awaitable[Response]]:
    """POST /{action}/{run_id}: the action itself."""

    async def perform(request: Request) -> Response:
        return await _checked_perform(request, action)

    return perform


def _confirm(request: Request, action: str) -> Response:
    only(request.query_params, ())
    config = settings(request)
    if not config.allow_cancel:
        return _off(request)
    run_id = _run_id(request)
    with data.reading(config.pool, config.statement_timeout_seconds) as reader:
        now = reader.now()
        run = _found(reader.repo.get_run(run_id), run_id)
        recovery = data.in_recovery(reader)
        tree = (
            data.tree(reader, run_id, data.TREE_ON_RUN_PAGE + 1) if action == "cancel-tree" else []
        )
    if recovery:
        return error_page(config.env, request, 403, "Cancelling is off", REPLICA_NOTE)
    return page(
        config.env,
        request.scope,
        "confirm.html",
        {
            "nav": "runs",
            "now": now,
            "run": run,
            "action": action,
            "tree": tree[: data.TREE_ON_RUN_PAGE],
            "more_tree": len(tree) > data.TREE_ON_RUN_PAGE,
            "csrf": csrf_token(config.secret, action, run_id),
        },
    )


async def _checked_perform(request: Request, action: str) -> Response:
    """Cancel or cancel-tree, once Origin, CSRF token and settings all agree."""
    config = settings(request)
    if not config.allow_cancel:
        return _off(request)
    if not same_origin(request):
        return error_page(
            config.env, request, 403, "Refused", "this form must be sent from the dashboard itself"
        )
    form = await _form(request)
    run_id = str(request.path_params["run_id"])
    if not _csrf_valid(config.secret, action, run_id, form.get("csrf", "")):
        message = "the form's CSRF token is missing, wrong or expired: open the confirmation again"
        return error_page(config.env, request, 403, "Refused", message)
    return await run_in_threadpool(functools.partial(_perform, request, action))


@guarded
def _perform(request: Request, action: str) -> Response:
    config = settings(request)
    run_id = _run_id(request)
    with data.writing(config.pool, config.statement_timeout_seconds) as writer:
        if data.in_recovery(writer):
            return error_page(config.env, request, 403, "Cancelling is off", REPLICA_NOTE)
        now = writer.now()
        before = _found(writer.repo.get_run(run_id), run_id)
        changed: list[AgentRun]
        if action == "requeue":  # requeue_run's rules; a refusal says why
            try:
                requeued = writer.repo.requeue_run(run_id, reason="requeued from the dashboard")
            except (InvalidArgument, ThreadBusy) as exc:
                return error_page(config.env, request, 409, "Not requeued", str(exc))
            changed = [requeued.run] if requeued.changed and requeued.run is not None else []
        elif action == "cancel-tree":
            changed = writer.repo.request_cancel_tree(run_id)
        else:
            after = writer.repo.request_cancel(run_id)
            changed = [after] if after is not None and after.status != before.status else []
    return page(
        config.env,
        request.scope,
        "cancelled.html",
        {"nav": "runs", "now": now, "run": before, "action": action, "changed": changed},
    )


def _off(request: Request) -> Response:
    message = "cancelling is off: start the dashboard with --allow-cancel to offer it"
    return error_page(settings(request).env, request, 403, "Cancelling is off", message)


def login_form(request: Request) -> Response:
    config = settings(request)
    if config.token is None:
        return RedirectResponse(f"{dashboard_root(request.scope)}/", status_code=303)
    return page(config.env, request.scope, "login.html", {"nav": "", "failed": False})


async def login(request: Request) -> Response:
    config = settings(request)
    if config.token is None:
        return RedirectResponse(f"{dashboard_root(request.scope)}/", status_code=303)
    if not same_origin(request):
        return error_page(config.env, request, 403, "Refused", "log in from the dashboard's form")
    given = (await _form(request)).get("token", "")
    if not hmac.compare_digest(given.encode("utf-8", "replace"), config.token.encode()):
        return page(
            config.env, request.scope, "login.html", {"nav": "", "failed": True}, status=401
        )
    root = dashboard_root(request.scope)
    response = RedirectResponse(f"{root}/", status_code=303)
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
