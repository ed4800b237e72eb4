"""A run: its fields, documents, attempts on a time axis, explanation, tree and links."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import Response

from agent_runs import validation as check
from agent_runs.dashboard import data
from agent_runs.dashboard.chart import attempt_timeline
from agent_runs.dashboard.common import REPLICA_NOTE, NotFound, guarded, settings
from agent_runs.dashboard.page_text import Shown, plain, shown
from agent_runs.dashboard.params import BadParameter, only, single
from agent_runs.dashboard.render import page
from agent_runs.errors import InvalidArgument
from agent_runs.explain import explain_run
from agent_runs.models import AgentRun

DOCUMENTS: Final = ("payload", "manifest", "output", "run")
# Latest attempts shown on a run page (a crash-looping run may hold thousands: the page stays
# bounded; `agent-runs attempts` lists them all).
ATTEMPTS_SHOWN: Final = 100
_JSON: Final = "application/json; charset=utf-8"
# A run id as echoed on a 404 page (a stored id has at most 64 characters).
RUN_ID_CHARS: Final = 64


# An ended run an operator may run again (requeue_run's rule; completed runs never).
_REQUEUABLE = frozenset({"failed", "cancelled", "interrupted"})


def path_run_id(request: Request) -> str:
    """The run id of the request's path, checked; an id no run can have is a 404."""
    run_id: str = request.path_params["run_id"]
    try:
        return check.identifier("run_id", run_id)
    except InvalidArgument:
        # Not a storable id, so certainly not a run's (no query needed).
        raise NotFound(_no_run(run_id)) from None


def found_run(run: AgentRun | None, run_id: str) -> AgentRun:
    """`run`, or a 404 naming `run_id` when there is none."""
    if run is None:
        raise NotFound(_no_run(run_id))
    return run


def _no_run(run_id: str) -> Shown:
    return Shown(f"no run with id {shown(run_id, RUN_ID_CHARS)}")


def worker_identity(owner_token: str | None) -> str | None:
    """The stable worker name of an owner token (the part before its last ':')."""
    if not owner_token:
        return None
    return owner_token.rsplit(":", 1)[0] if ":" in owner_token else owner_token


@guarded
def run_page(request: Request) -> Response:
    only(request.query_params, ())
    config = settings(request)
    run_id = path_run_id(request)
    with data.reading(config.pool, config.statement_timeout_seconds) as reader:
        now = reader.now()
        run = found_run(reader.repo.get_run(run_id), run_id)
        attempts = reader.repo.list_run_attempts(run_id)
        requeues = reader.repo.list_run_requeues(run_id)
        parent = reader.repo.get_run(run.created_by_run_id) if run.created_by_run_id else None
        children = data.children(reader, run_id)
        tree = data.tree(reader, run_id, data.TREE_ON_RUN_PAGE)
        recovery = data.in_recovery(reader)
        key = run.concurrency_key  # a waiting run's explanation says when its key is full
        key_limit = None if key is None or run.is_terminal else reader.repo.get_limit(key)
    last_owner = attempts[-1].worker_id if attempts else run.worker_id
    shown = attempts[-ATTEMPTS_SHOWN:]
    return page(
        config.env,
        request.scope,
        "run.html",
        {
            "nav": "runs",
            "now": now,
            "run": run,
            "attempts": shown,
            "earlier_attempts": len(attempts) - len(shown),
            # A run in a final state does not change: its page is never refreshed under the
            # reader (the tree section may, on reload).
            "live_page": not run.is_terminal,
            "final_page": run.is_terminal,
            "explanation": explain_run(run, attempts, requeues, key_limit=key_limit),
            "timeline": attempt_timeline(shown, now),
            "parent": parent,
            "parent_missing": run.created_by_run_id is not None and parent is None,
            "children": children[: data.CHILDREN],
            "more_children": len(children) > data.CHILDREN,
            "tree": tree,
            "tree_levels": data.TREE_LEVELS,
            "worker": worker_identity(last_owner),
            "can_cancel": config.allow_cancel and not recovery and not run.is_terminal,
            "can_requeue": config.allow_cancel and not recovery and run.status in _REQUEUABLE,
            "requeues": requeues,
            "cancel_note": REPLICA_NOTE if config.allow_cancel and recovery else None,
        },
    )


@guarded
def tree_page(request: Request) -> Response:
    """The tree from its root (or 100 levels up), or with `start=here` from the run down."""
    only(request.query_params, ("start",))
    start = single(request.query_params, "start")
    if start not in ("", "root", "here"):
        raise BadParameter("start", "start must be root (the default) or here")
    config = settings(request)
    run_id = path_run_id(request)
    with data.reading(config.pool, config.statement_timeout_seconds) as reader:
        now = reader.now()
        run = found_run(reader.repo.get_run(run_id), run_id)
        tree = data.tree(reader, run_id, data.TREE_PAGE, from_run=start == "here")
    return page(
        config.env,
        request.scope,
        "tree.html",
        {
            "nav": "runs",
            "now": now,
            "run": run,
            "tree": tree,
            "live_page": not all(node["status"] in data.FINAL_STATUSES for node in tree.nodes),
            "final_page": True,
            "from_run": start == "here",
            "limit": data.TREE_PAGE,
            "levels": data.TREE_LEVELS,
        },
    )


@guarded
def document(request: Request) -> Response:
    """The whole payload, manifest, output or run as JSON (the run page shows them cut)."""
    only(request.query_params, ())
    config = settings(request)
    kind = request.path_params["kind"]
    if kind not in DOCUMENTS:
        choices = ", ".join(DOCUMENTS)
        raise NotFound(Shown(f"no document {shown(kind, 50)}; try one of {choices}"))
    run_id = path_run_id(request)
    with data.reading(config.pool, config.statement_timeout_seconds) as reader:
        run = found_run(reader.repo.get_run(run_id), run_id)
    value: Any
    if kind == "payload":
        value = run.input_payload
    elif kind == "manifest":
        value = run.manifest
    elif kind == "output":
        value = run.output
    else:
        value = {k: plain(v) for k, v in dataclasses.asdict(run).items()}
    # ensure_ascii: every character outside ASCII as an escape, so the body is plain ASCII.
    body = json.dumps(value, indent=2, ensure_ascii=True, sort_keys=True)
    return Response(
        body + "\n",
        media_type=_JSON,
        headers={"cache-control": "no-store", "content-disposition": "inline"},
    )
