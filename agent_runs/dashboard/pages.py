"""The list pages: overview, runs, workers, and /healthz."""

from __future__ import annotations

from datetime import timedelta
from typing import Final

from starlette.requests import Request
from starlette.responses import Response

from agent_runs.dashboard import data
from agent_runs.dashboard.chart import per_minute_chart
from agent_runs.dashboard.common import guarded, settings
from agent_runs.dashboard.params import BadParameter, only, single
from agent_runs.dashboard.render import page
from agent_runs.durations import parse_duration
from agent_runs.errors import InvalidArgument

STUCK_SHOWN: Final = 10
HOUR: Final = timedelta(hours=1)
WORKERS_DEFAULT_WINDOW: Final = "1h"


@guarded
def overview(request: Request) -> Response:
    only(request.query_params, ())
    config = settings(request)
    with data.reading(config.pool, config.statement_timeout_seconds) as reader:
        now = reader.now()
        live = data.live(reader)
        stats = reader.repo.run_stats(since=HOUR, now=now)
        stuck = reader.repo.list_run_listings(stuck=True, limit=STUCK_SHOWN + 1, now=now)
        minutes = data.per_minute(reader, now)
        day, day_at, hour_at_day = config.cache.day(reader, now)
        workers = data.workers(reader, now - HOUR, data.TOP)
    oldest_pending = live.oldest.get("pending")
    return page(
        config.env,
        request.scope,
        "overview.html",
        {
            "nav": "overview",
            "live_page": True,
            "now": now,
            "live": live,
            "live_statuses": data.LIVE_STATUSES,
            "terminal": data.FINAL_STATUSES,
            "last_hour": hour_at_day,
            "last_day": day.by_status,
            "day_at": day_at,
            "stats": stats,
            "oldest_pending": oldest_pending,
            "oldest_pending_age": None if oldest_pending is None else now - oldest_pending,
            "stuck": stuck[:STUCK_SHOWN],
            "more_stuck": len(stuck) > STUCK_SHOWN,
            "chart": per_minute_chart(minutes.minutes),
            "agents": day.agents,
            "workers": workers,
        },
    )


@guarded
def workers(request: Request) -> Response:
    only(request.query_params, ("since",))
    config = settings(request)
    since_text = single(request.query_params, "since") or WORKERS_DEFAULT_WINDOW
    try:
        window = parse_duration("since", since_text)
    except InvalidArgument as exc:
        raise BadParameter("since", str(exc)) from None
    with data.reading(config.pool, config.statement_timeout_seconds) as reader:
        now = reader.now()
        rows = data.workers(reader, now - window)
    return page(
        config.env,
        request.scope,
        "workers.html",
        {
            "nav": "workers",
            "live_page": True,
            "now": now,
            "since": since_text,
            "windows": ("15m", "1h", "6h", "24h", "7d"),
            "workers": rows,
            "limit": data.WORKERS_TOP,
        },
    )


@guarded
def healthz(request: Request) -> Response:
    only(request.query_params, ())
    config = settings(request)
    with data.reading(config.pool, config.statement_timeout_seconds) as reader:
        recovery = data.in_recovery(reader)
    body = "ok (hot standby, read only)\n" if recovery else "ok\n"
    return Response(
        body, media_type="text/plain; charset=utf-8", headers={"cache-control": "no-store"}
    )
