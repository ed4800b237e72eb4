"""/keys: each concurrency key with a limit, its running runs, its limit, its waiting runs and
how long the oldest has waited."""

from __future__ import annotations

from typing import Final

from starlette.requests import Request
from starlette.responses import Response

from agent_runs.dashboard import data
from agent_runs.dashboard.common import guarded, settings
from agent_runs.dashboard.params import only
from agent_runs.dashboard.render import page
from agent_runs.sql import query

KEYS_SHOWN: Final = 1000


@guarded
def keys(request: Request) -> Response:
    only(request.query_params, ())
    config = settings(request)
    with data.reading(config.pool, config.statement_timeout_seconds) as reader:
        now = reader.now()
        rows = reader.rows(query("list_limits"), {})
    shown = [
        {**row, "oldest_waiting_age": None if row["oldest_waiting_at"] is None
         else now - row["oldest_waiting_at"], "full": row["running"] >= row["max_running"]}
        for row in rows[:KEYS_SHOWN]
    ]  # fmt: skip
    return page(
        config.env,
        request.scope,
        "keys.html",
        {"nav": "keys", "live_page": True, "now": now, "keys": shown,
         "more": len(rows) > KEYS_SHOWN, "limit": KEYS_SHOWN},
    )  # fmt: skip
