"""/runs: the filtered list of runs, with status tabs and their counts; /find: go to a run by
its id or an id prefix."""

from __future__ import annotations

import dataclasses
from datetime import datetime
from typing import Any, Final

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response

from agent_runs import validation as check
from agent_runs.cursors import decode_cursor, keyset_cursor
from agent_runs.dashboard import data
from agent_runs.dashboard.common import NotFound, guarded, settings
from agent_runs.dashboard.guard import dashboard_root
from agent_runs.dashboard.page_text import Shown, shown
from agent_runs.dashboard.params import (
    OUTCOMES,
    BadParameter,
    RunsQuery,
    only,
    runs_query,
    single,
)
from agent_runs.dashboard.render import page, run_segment
from agent_runs.errors import InvalidArgument
from agent_runs.models import RunStatus
from agent_runs.repository.operator_queries import runs_cursor

# Runs listed when an id prefix matches more than one.
FOUND_SHOWN: Final = 20


def _finished_cursor(row: dict[str, Any], key: str = "finished_at") -> str:
    """The keyset cursor after `row` in the runs-by-finish order."""
    return keyset_cursor(row[key], row["id"])


def _before(query: RunsQuery) -> tuple[datetime, str] | None:
    try:
        return decode_cursor(query.before) if query.before else None
    except InvalidArgument as exc:
        raise BadParameter("before", str(exc)) from None


def _page_by_finish(
    reader: data.Reader, query: RunsQuery, now: Any
) -> tuple[list[Any], str | None]:
    before = _before(query)
    filters = query.filters()
    rows = data.finished_runs(
        reader,
        window_start=now - query.finished_window(),
        before=before,
        filters={
            "statuses": filters["statuses"],
            "agent_slug": filters["agent_slug"],
            "thread_id": filters["thread_id"],
            "uid": filters["uid"],
            "error_type": query.error_type or None,
        },
        limit=query.limit,
    )
    cursor = _finished_cursor(rows[-1]) if len(rows) == query.limit else None
    return rows, cursor


def _page_by_attempt(
    reader: data.Reader, query: RunsQuery, now: Any
) -> tuple[list[Any], str | None]:
    before = _before(query)
    rows = data.runs_by_attempt(
        reader,
        window_start=now - query.finished_window(),
        before=before,
        filters={
            "outcomes": list(query.outcomes) or None,
            "error_type": query.attempt_error_type or None,
            "worker": query.worker or None,
        },
        limit=query.limit,
    )
    cursor = _finished_cursor(rows[-1], "matched_at") if len(rows) == query.limit else None
    return rows, cursor


def _tabs(query: RunsQuery, live: data.Live, day: data.Agents) -> list[dict[str, Any]]:
    """Status tabs: live statuses with their counts now, final ones with the last day's."""
    only_status = query.statuses[0] if len(query.statuses) == 1 else None
    tabs: list[dict[str, Any]] = [
        {
            "label": "all",
            "count": None,
            "link": "",
            "current": not query.statuses
            and not (query.by_finish or query.by_attempt or query.scheduled),
        }
    ]
    for status in data.LIVE_STATUSES:
        tabs.append(
            {
                "label": status,
                "count": live.counts.get(status, 0),
                "note": "now",
                "link": f"status={status}",
                "current": only_status == status and not (query.by_finish or query.by_attempt),
            }
        )
        if status == "pending":
            tabs.append(
                {
                    "label": "scheduled",
                    "count": live.scheduled,
                    "note": "not yet due",
                    "link": "scheduled=1",
                    "current": query.scheduled,
                }
            )
    for status in data.FINAL_STATUSES:
        tabs.append(
            {
                "label": status,
                "count": day.by_status.get(status, 0),
                "note": "last day",
                "link": f"status={status}&finished=1d",
                "current": only_status == status and query.finished == "1d",
            }
        )
    return tabs


def _row(listing: Any, times: dict[str, Any]) -> dict[str, Any]:
    """A listing as a row of the table, with its start and finish times."""
    row = {field.name: getattr(listing, field.name) for field in dataclasses.fields(listing)}
    row["status"] = str(getattr(listing.status, "value", listing.status))
    row["started_at"] = times.get("started_at")
    row["finished_at"] = times.get("finished_at")
    return row


def _scheduled(reader: data.Reader, query: RunsQuery, now: datetime) -> list[dict[str, Any]]:
    """Pending runs not yet available, the soonest first (one page: no cursor)."""
    runs = reader.repo.list_scheduled_runs(
        agent_slug=query.agent_slug or None, limit=query.limit, now=now
    )
    return [
        {
            "id": run.id,
            "status": str(run.status),
            "agent_slug": run.agent_slug,
            "thread_id": run.thread_id,
            "uid": run.uid,
            "created_at": run.created_at,
            "error_type": run.error_type,
            "attempt_count": "–",  # a listing's count; the run page has the attempts
            "last_worker_id": None,
            "started_at": run.started_at,
            "finished_at": None,
            "available_at": run.available_at,
        }
        for run in runs
    ]


@guarded
def runs(request: Request) -> Response:
    config = settings(request)
    query = runs_query(request.query_params)
    with data.reading(config.pool, config.statement_timeout_seconds) as reader:
        now = reader.now()
        live = config.cache.live(reader)
        day = config.cache.day(reader, now)[0]
        if query.scheduled:
            listings, cursor = _scheduled(reader, query, now), None
        elif query.by_attempt:
            listings, cursor = _page_by_attempt(reader, query, now)
        elif query.by_finish:
            listings, cursor = _page_by_finish(reader, query, now)
        else:
            try:
                found = reader.repo.list_run_listings(**query.filters(), now=now)
            except InvalidArgument as exc:
                name = str(exc).split(" ", 1)[0]
                raise BadParameter(name, str(exc)) from None
            cursor = runs_cursor(found[-1]) if len(found) == query.limit else None
            times = data.run_times(reader, [listing.id for listing in found])
            listings = [_row(listing, times.get(listing.id, {})) for listing in found]
    return page(
        config.env,
        request.scope,
        "runs.html",
        {
            "nav": "runs",
            "live_page": True,
            "now": now,
            "query": query,
            "listings": listings,
            "tabs": _tabs(query, live, day),
            "can_act": config.allow_cancel and not live.in_recovery,
            "window": query.finished or "1d",
            "next_link": None if cursor is None else query.link(before=cursor),
            "first_link": query.link(before=None) if query.before else None,
            "statuses": [s.value for s in RunStatus],
            "outcomes": OUTCOMES,
        },
    )


@guarded
def find(request: Request) -> Response:
    """GET /find?run=ID: the run with that id, or the only run whose id starts with it; a page
    listing the first matches when several do."""
    only(request.query_params, ("run",))
    given = single(request.query_params, "run")
    if not given:
        raise BadParameter("run", "run must be a run id or the start of one")
    try:
        prefix = check.identifier("run", given)
    except InvalidArgument as exc:
        raise BadParameter("run", str(exc)) from None
    config = settings(request)
    with data.reading(config.pool, config.statement_timeout_seconds) as reader:
        now = reader.now()
        exact = reader.repo.get_run(prefix)
        found = [] if exact else data.find_runs(reader, prefix, FOUND_SHOWN + 1)
    root = dashboard_root(request.scope)
    if exact is not None or len(found) == 1:
        run_id = exact.id if exact is not None else str(found[0]["id"])
        return RedirectResponse(f"{root}/runs/{run_segment(run_id)}", status_code=303)
    if not found:
        raise NotFound(Shown(f"no run has an id that is or starts with {shown(prefix, 64)}"))
    return page(
        config.env,
        request.scope,
        "found.html",
        {
            "nav": "runs",
            "now": now,
            "prefix": prefix,
            "found": found[:FOUND_SHOWN],
            "more": len(found) > FOUND_SHOWN,
        },
    )
