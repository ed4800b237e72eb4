"""Instants: an injected `now` and the lease it starts, inside the window the schema accepts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from agent_runs.errors import InvalidArgument
from agent_runs.validation.limits import TIME_MAX, TIME_MIN
from agent_runs.validation.numbers import lease_seconds
from agent_runs.validation.text import shown


def now(value: object, lease_seconds: float | None = None) -> datetime | None:
    """An injected clock: timezone-aware, returned in UTC; None means the database's now().

    `now` and, when `lease_seconds` (already checked) is given, `now + lease_seconds` must lie
    in [TIME_MIN, TIME_MAX), the window the schema accepts.
    """
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidArgument(f"now must be a datetime or None, got {type(value).__name__}")
    utc = instant("now", value)
    if lease_seconds is not None and utc + timedelta(seconds=lease_seconds) >= TIME_MAX:
        raise InvalidArgument(
            f"now + lease_seconds must be before {TIME_MAX} UTC, got now {utc} "
            f"and lease_seconds {lease_seconds!r}"
        )
    # A plain datetime: psycopg sends exactly this instant, whatever the subclass.
    return datetime(
        utc.year, utc.month, utc.day, utc.hour, utc.minute, utc.second, utc.microsecond, UTC
    )


def instant(name: str, value: datetime) -> datetime:
    """An aware datetime in UTC inside [TIME_MIN, TIME_MAX); naive, broken or out-of-range
    ones are refused by name (never an OverflowError from the conversion)."""
    try:
        offset = value.utcoffset()
    except Exception as exc:  # a broken tzinfo: its own error, named
        raise InvalidArgument(f"{name} has a tzinfo that fails: {shown(exc)}") from None
    if offset is None:
        raise InvalidArgument(f"{name} must be timezone-aware (naive datetimes are ambiguous)")
    try:
        utc = value.astimezone(UTC)
    except (OverflowError, ValueError):
        raise InvalidArgument(f"{name} must lie in [{TIME_MIN}, {TIME_MAX}) UTC") from None
    if not TIME_MIN <= utc < TIME_MAX:
        raise InvalidArgument(f"{name} must lie in [{TIME_MIN}, {TIME_MAX}) UTC, got {utc}")
    return utc


def lease(seconds: object, at: object) -> dict[str, Any]:
    """The `lease_seconds` and `now` parameters of a transition that sets a lease: both checked
    (`now + lease_seconds` inside the window too), the lease once."""
    checked = lease_seconds(seconds)
    return {"lease_seconds": checked, "now": now(at, checked)}
