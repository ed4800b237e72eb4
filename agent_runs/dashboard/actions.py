"""The dashboard's only writes: an action on a run, or on runs selected in the runs table, POST
only after a confirmation page, with a CSRF token and the request's Origin checked to be the
dashboard's own; then a redirect to a result page that says what changed (reloading it never
does anything again).

The actions exist only with allow_cancel, never on a hot-standby replica. Each is an `Action`
in ACTIONS: its words, and the repository call that performs it under the repository's rules
(cancel: `request_cancel`; cancel-tree: `request_cancel_tree`; requeue: `requeue_run`). Another
action is one more entry.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final
from urllib.parse import unquote, urlencode

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from agent_runs import validation as check
from agent_runs.dashboard import data
from agent_runs.dashboard.common import REPLICA_NOTE, guarded, settings
from agent_runs.dashboard.forms import read_fields, same_origin
from agent_runs.dashboard.guard import dashboard_root
from agent_runs.dashboard.params import BadParameter, only, single
from agent_runs.dashboard.render import error_page, page
from agent_runs.dashboard.run_page import found_run, path_run_id
from agent_runs.errors import InvalidArgument, ThreadBusy
from agent_runs.models import AgentRun
from agent_runs.repository import AgentRunRepository

CSRF_SECONDS: Final = 15 * 60
# Runs one bulk action may select (one page of the runs table at most).
MAX_SELECTED: Final = 100


_CANCEL_EXPLAINS: Final = (
    "A pending run that never started becomes cancelled at once; any other live run becomes"
    " cancel_requested, and its worker stops it on its next heartbeat. Finished runs do not"
    " change."
)


@dataclass(frozen=True, slots=True)
class Action:
    name: str  # its URL segment
    question: str  # the confirmation page's heading
    button: str  # the confirming button
    done: str  # the result page's heading when runs changed
    perform: Callable[[AgentRunRepository, str], list[AgentRun]]  # the runs that changed
    reaches_tree: bool = False  # the confirmation lists the runs below the run
    bulk: bool = False  # offered for runs selected in the runs table
    explains: str = _CANCEL_EXPLAINS  # what the action does, on the confirmation page
    unchanged: str = "already cancelled, cancel requested, or finished"  # why nothing changed


def _cancel(repo: AgentRunRepository, run_id: str) -> list[AgentRun]:
    before = repo.get_run(run_id)
    after = repo.request_cancel(run_id)
    changed = after is not None and before is not None and after.status != before.status
    return [after] if changed and after is not None else []


def _requeue(repo: AgentRunRepository, run_id: str) -> list[AgentRun]:
    requeued = repo.requeue_run(run_id, reason="requeued from the dashboard")
    return [requeued.run] if requeued.changed and requeued.run is not None else []


ACTIONS: Final = {
    "cancel": Action(
        "cancel", "Cancel this run?", "Yes, cancel the run", "Cancel requested", _cancel, bulk=True
    ),
    "cancel-tree": Action(
        "cancel-tree",
        "Cancel this run and its sub-agent runs?",
        "Yes, cancel the tree",
        "Cancel requested",
        lambda repo, run_id: repo.request_cancel_tree(run_id),
        reaches_tree=True,
    ),
    "requeue": Action(
        "requeue",
        "Requeue this run?",
        "Yes, requeue the run",
        "Requeued",
        _requeue,
        explains=(
            "A failed, cancelled or interrupted run goes back to pending, available now, with a"
            " fresh attempt budget; the requeue is recorded. A completed run is never requeued:"
            " create a new run to run it again."
        ),
        unchanged="the run has not ended yet",
    ),
}


def _mac(secret: bytes, *parts: str) -> str:
    return hmac.new(secret, "\0".join(parts).encode(), hashlib.sha256).hexdigest()


def csrf_token(secret: bytes, action: str, subject: str, issued: int | None = None) -> str:
    """A token for `action` on `subject` (a run id, or the selected ids joined by NUL)."""
    issued = int(time.time()) if issued is None else issued
    return f"{issued}.{_mac(secret, action, subject, str(issued))}"


def _csrf_valid(secret: bytes, action: str, subject: str, token: str) -> bool:
    issued_text, _, _mac_text = token.partition(".")
    if not (issued_text.isascii() and issued_text.isdigit()) or len(issued_text) > 12:
        return False
    issued = int(issued_text)
    if not 0 <= time.time() - issued <= CSRF_SECONDS:
        return False
    expected = csrf_token(secret, action, subject, issued)
    return hmac.compare_digest(expected.encode(), token.encode("utf-8", "replace"))


def _off(request: Request) -> Response:
    message = "cancelling is off: start the dashboard with --allow-cancel to offer it"
    return error_page(settings(request).env, request, 403, "Cancelling is off", message)


# -- one run ---------------------------------------------------------------------------------


def confirmer(name: str) -> Callable[[Request], Response]:
    """GET /{action}/{run_id}: the confirmation page (a page, not a script dialog)."""

    @guarded
    def confirm(request: Request) -> Response:
        only(request.query_params, ())
        config = settings(request)
        if not config.allow_cancel:
            return _off(request)
        action = ACTIONS[name]
        run_id = path_run_id(request)
        with data.reading(config.pool, config.statement_timeout_seconds) as reader:
            now = reader.now()
            run = found_run(reader.repo.get_run(run_id), run_id)
            recovery = data.in_recovery(reader)
            tree = (
                data.tree(reader, run_id, data.TREE_ON_RUN_PAGE, from_run=True)
                if action.reaches_tree
                else None
            )
        if recovery:
            return error_page(config.env, request, 403, "Cancelling is off", REPLICA_NOTE)
        context = {
            "nav": "runs",
            "now": now,
            "runs": [run],
            "run": run,
            "action": action,
            "tree": tree,
            "csrf": csrf_token(config.secret, name, run_id),
            "form_action": f"/{name}/",
        }
        return page(config.env, request.scope, "confirm.html", context)

    return confirm


def performer(name: str) -> Callable[[Request], Awaitable[Response]]:
    """POST /{action}/{run_id}: the action, then a redirect to its result."""

    async def perform(request: Request) -> Response:
        refused = await _refused(request)
        if refused is not None:
            return refused
        fields = await read_fields(request)
        run_id = str(request.path_params["run_id"])
        token = (fields.get("csrf") or [""])[0]
        if not _csrf_valid(settings(request).secret, name, run_id, token):
            return _bad_csrf(request)
        return await run_in_threadpool(functools.partial(_perform, request, name, [run_id]))

    return perform


# -- runs selected in the runs table ---------------------------------------------------------


def _selected(values: list[str]) -> list[str]:
    """The selected run ids (percent-encoded in the form), checked, in order, without repeats."""
    ids = list(dict.fromkeys(unquote(v) for v in values if v))
    if not ids:
        raise BadParameter("run", "select at least one run")
    if len(ids) > MAX_SELECTED:
        raise BadParameter("run", f"select at most {MAX_SELECTED} runs at once")
    try:
        return [check.identifier("run", run_id) for run_id in ids]
    except InvalidArgument as exc:
        raise BadParameter("run", str(exc)) from None


def bulk_confirmer(name: str) -> Callable[[Request], Response]:
    """GET /selected/{action}?run=ID&run=ID…: the confirmation page for the selected runs."""

    @guarded
    def confirm(request: Request) -> Response:
        only(request.query_params, ("run",))
        config = settings(request)
        if not config.allow_cancel:
            return _off(request)
        action = ACTIONS[name]
        ids = _selected(request.query_params.getlist("run"))
        with data.reading(config.pool, config.statement_timeout_seconds) as reader:
            now = reader.now()
            runs = [run for run in map(reader.repo.get_run, ids) if run is not None]
            recovery = data.in_recovery(reader)
        if recovery:
            return error_page(config.env, request, 403, "Cancelling is off", REPLICA_NOTE)
        found = [run.id for run in runs]
        context = {
            "nav": "runs",
            "now": now,
            "runs": runs,
            "run": None,
            "action": action,
            "tree": None,
            "missing": len(ids) - len(found),
            "csrf": csrf_token(config.secret, name, "\0".join(found)),
        }
        return page(config.env, request.scope, "confirm.html", context)

    return confirm


def bulk_performer(name: str) -> Callable[[Request], Awaitable[Response]]:
    """POST /selected/{action}: the action on each selected run, then its result."""

    async def perform(request: Request) -> Response:
        refused = await _refused(request)
        if refused is not None:
            return refused
        fields = await read_fields(request)
        try:
            ids = _selected(fields.get("run", []))
        except BadParameter:
            ids = []
        token = (fields.get("csrf") or [""])[0]
        if not ids or not _csrf_valid(settings(request).secret, name, "\0".join(ids), token):
            return _bad_csrf(request)
        return await run_in_threadpool(functools.partial(_perform, request, name, ids))

    return perform


# -- performing, and the result --------------------------------------------------------------


async def _refused(request: Request) -> Response | None:
    config = settings(request)
    if not config.allow_cancel:
        return _off(request)
    if not same_origin(request):
        message = "this form must be sent from the dashboard itself"
        return error_page(config.env, request, 403, "Refused", message)
    return None


def _bad_csrf(request: Request) -> Response:
    message = "the form's CSRF token is missing, wrong or expired: open the confirmation again"
    return error_page(settings(request).env, request, 403, "Refused", message)


@guarded
def _perform(request: Request, name: str, run_ids: list[str]) -> Response:
    config = settings(request)
    changed: list[AgentRun] = []
    with data.writing(config.pool, config.statement_timeout_seconds) as writer:
        if data.in_recovery(writer):
            return error_page(config.env, request, 403, "Cancelling is off", REPLICA_NOTE)
        for run_id in run_ids:
            found_run(writer.repo.get_run(run_id), run_id)
            try:
                changed += ACTIONS[name].perform(writer.repo, run_id)
            except (InvalidArgument, ThreadBusy) as exc:  # the rule's refusal says why
                return error_page(config.env, request, 409, "Refused", str(exc))
    issued = str(int(time.time()))
    subject = run_ids[0] if len(run_ids) == 1 else ""
    counts = (str(len(changed)), str(len(run_ids)))
    query = {
        "run": subject,
        "changed": counts[0],
        "selected": counts[1],
        "at": issued,
        "sig": _mac(config.secret, "result", name, subject, *counts, issued),
    }
    root = dashboard_root(request.scope)
    return RedirectResponse(f"{root}/done/{name}?{urlencode(query)}", status_code=303)


@guarded
def result(request: Request) -> Response:
    """GET /done/{action}?…: what an action changed (signed by the dashboard: a link cannot
    claim a change that did not happen)."""
    params = request.query_params
    only(params, ("run", "changed", "selected", "at", "sig"))
    config = settings(request)
    name = request.path_params["action"]
    values = [single(params, key) for key in ("run", "changed", "selected", "at")]
    expected = _mac(config.secret, "result", str(name), *values)
    if name not in ACTIONS or not hmac.compare_digest(
        expected.encode(), single(params, "sig").encode("utf-8", "replace")
    ):
        raise BadParameter("sig", "this result link was not made by this dashboard")
    subject, changed, selected = values[0], int(values[1]), int(values[2])
    run = None
    with data.reading(config.pool, config.statement_timeout_seconds) as reader:
        now = reader.now()
        if subject:
            run = reader.repo.get_run(subject)
    context = {
        "nav": "runs",
        "now": now,
        "action": ACTIONS[name],
        "run": run,
        "changed": changed,
        "selected": selected,
    }
    return page(config.env, request.scope, "done.html", context)
