"""Render a run and its attempt history: the table and JSON of `agent-runs attempts`.

The table escapes every value from a user or an agent (agent_runs.display.escape), so each
prints as one cell of visible text; the JSON keeps every value exact.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from agent_runs.display import aligned, escape
from agent_runs.explain import Explanation
from agent_runs.models import AgentRun, RunAttempt
from agent_runs.policies import RunRequeue

ATTEMPT_COLUMNS = ("attempt", "owner", "started", "finished", "duration", "outcome", "error")
ATTEMPT_JSON_FIELDS = (
    "attempt_no",
    "worker_id",
    "started_at",
    "finished_at",
    "outcome",
    "error_type",
    "error_message",
    "resumed_from",
    "resumed_step",
    "retry_at",
)


def history_json(
    run: AgentRun,
    attempts: Sequence[RunAttempt],
    explanation: Explanation,
    requeues: Sequence[RunRequeue] = (),
) -> dict[str, Any]:
    """`{"run": {...}, "attempts": [...], "requeues": [...], "explanation": "..."}` with
    JSON-ready values."""
    return {
        "run": {k: _json_value(v) for k, v in dataclasses.asdict(run).items()},
        "attempts": [
            {field: _json_value(getattr(a, field)) for field in ATTEMPT_JSON_FIELDS}
            for a in attempts
        ],
        "requeues": [
            {k: _json_value(v) for k, v in dataclasses.asdict(q).items() if k != "id"}
            for q in requeues
        ],
        "explanation": explanation.text,
    }


def render_history(run: AgentRun, attempts: Sequence[RunAttempt], explanation: Explanation) -> str:
    """The run in two lines, its attempts as a table, then the explanation line."""
    lines = [
        f"run {escape(run.id)}  status {run.status}  agent {escape(run.agent_slug)}  "
        f"thread {escape(run.thread_id)}  uid {escape(run.uid)}  type {escape(run.run_type)}",
        f"  created {_ts(run.created_at)}  started {_ts(run.started_at)}  "
        f"finished {_ts(run.finished_at)}",
    ]
    if run.error_type or run.error_message:
        lines.append(f"  error {_error(run.error_type, run.error_message, limit=200)}")
    if run.worker_id:
        lines.append(f"  owner {escape(run.worker_id)}  lease until {_ts(run.lease_expires_at)}")
    lines.append("")
    if attempts:
        lines.extend(attempts_table(attempts))
    else:
        lines.append("  (no attempts recorded)")
    lines.append("")
    lines.append(("" if explanation.explained else "!! ") + explanation.text)
    return "\n".join(lines)


def attempts_table(attempts: Sequence[RunAttempt]) -> list[str]:
    rows = [ATTEMPT_COLUMNS] + [
        (
            str(a.attempt_no),
            escape(a.worker_id),
            _ts(a.started_at),
            _ts(a.finished_at) if a.finished_at else "(open)",
            _duration(a.started_at, a.finished_at),
            str(a.outcome) if a.outcome else "-",
            _error(a.error_type, a.error_message, limit=60),
        )
        for a in attempts
    ]
    return aligned(rows)


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def _ts(value: datetime | None) -> str:
    if value is None:
        return "-"
    return value.strftime("%Y-%m-%d %H:%M:%S.") + f"{value.microsecond // 1000:03d}"


def _duration(started: datetime, finished: datetime | None) -> str:
    if finished is None:
        return "-"
    return f"{(finished - started).total_seconds():.3f}s"


def _error(error_type: str | None, message: str | None, *, limit: int) -> str:
    if not error_type and not message:
        return "-"
    if error_type and message:
        text = f"{escape(error_type)}: {escape(message)}"
    else:
        text = escape(error_type or message)
    return text if len(text) <= limit else text[: limit - 1] + "…"
