"""A statement's row as a value: AgentRun and RunAttempt, their timestamps as UTC."""

from __future__ import annotations

from dataclasses import fields
from datetime import UTC, datetime
from typing import Any, Final

from agent_runs.models import AgentRun, RunAttempt, RunStatus
from agent_runs.operator_values import RunListing
from agent_runs.transport import Row

_RUN_FIELDS: Final = tuple(f.name for f in fields(AgentRun))
_ATTEMPT_FIELDS: Final = tuple(f.name for f in fields(RunAttempt))
_TIMESTAMPS: Final = frozenset(
    {
        "heartbeat_at",
        "lease_expires_at",
        "manifest_recorded_at",
        "started_at",
        "finished_at",
        "created_at",
        "updated_at",
        "available_at",
        "retry_at",
    }
)
# Positions of the timestamp fields among each model's fields (made timezone-aware UTC).
_RUN_TIMESTAMPS: Final = tuple(i for i, n in enumerate(_RUN_FIELDS) if n in _TIMESTAMPS)
_ATTEMPT_TIMESTAMPS: Final = tuple(i for i, n in enumerate(_ATTEMPT_FIELDS) if n in _TIMESTAMPS)


def utc(value: datetime) -> datetime:
    """A timestamp as UTC (psycopg gives the session's time zone)."""
    return value if value.tzinfo is UTC else value.astimezone(UTC)


def _utc(fields_: list[Any], stamps: tuple[int, ...]) -> list[Any]:
    """The timestamps among a model's fields as UTC (psycopg gives the session's time zone)."""
    for i in stamps:
        value = fields_[i]
        if value is not None:
            fields_[i] = utc(value)
    return fields_


def run_of(row: Row) -> AgentRun:
    pick = row.shape.picker("run", _RUN_FIELDS)
    if pick is None:  # pragma: no cover - every run statement returns the run's columns
        raise AssertionError("this result carries no run")
    return AgentRun(*_utc(list(pick(row.values)), _RUN_TIMESTAMPS))


def attempt_of(row: Row) -> RunAttempt:
    pick = row.shape.picker("attempt", _ATTEMPT_FIELDS)
    if pick is None:  # pragma: no cover - every attempt statement returns its columns
        raise AssertionError("this result carries no attempt")
    return RunAttempt(*_utc(list(pick(row.values)), _ATTEMPT_TIMESTAMPS))


def listing_of(row: Row) -> RunListing:
    """A list_runs row (the listing's columns) as a RunListing."""
    return RunListing(
        id=row["id"],
        status=RunStatus(row["status"]),
        agent_slug=row["agent_slug"],
        thread_id=row["thread_id"],
        uid=row["uid"],
        created_at=utc(row["created_at"]),
        error_type=row["error_type"],
        attempt_count=int(row["attempt_count"]),
        last_worker_id=row["last_worker_id"],
    )
