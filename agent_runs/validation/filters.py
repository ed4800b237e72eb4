"""An operator's filters: run statuses, a window (since), spans of time, and flags."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime, timedelta

from agent_runs.durations import MAX_DURATION
from agent_runs.errors import InvalidArgument
from agent_runs.models import RunStatus
from agent_runs.validation.times import instant


def span(name: str, value: object, *, allow_zero: bool = False) -> float:
    """A timedelta as seconds: > 0 (or >= 0) and at most 100 years."""
    if not isinstance(value, timedelta):
        raise InvalidArgument(f"{name} must be a timedelta, got {type(value).__name__}")
    if value < timedelta(0) or (value == timedelta(0) and not allow_zero) or value > MAX_DURATION:
        low = ">= 0" if allow_zero else "> 0"
        raise InvalidArgument(f"{name} must be {low} and at most {MAX_DURATION.days} days")
    return value.total_seconds()


def since(value: object) -> tuple[datetime | None, float | None]:
    """since: an aware datetime (since_at) or a timedelta back from now (since_seconds)."""
    if value is None:
        return None, None
    if isinstance(value, datetime):
        return instant("since", value), None
    if isinstance(value, timedelta):
        return None, span("since", value, allow_zero=True)
    raise InvalidArgument(f"since must be an aware datetime or a timedelta, not {value!r}")


def statuses(value: object) -> list[str] | None:
    """None (every status), or a non-empty collection of run statuses as their values."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise InvalidArgument("statuses must be a collection of run statuses or None")
    found: list[str] = []
    for item in value:
        try:
            found.append(RunStatus(item).value)
        except ValueError:
            raise InvalidArgument(f"statuses: {item!r} is not a run status") from None
    if not found:
        raise InvalidArgument("statuses must not be empty (use None for every status)")
    return found


def flag(name: str, value: object) -> bool:
    """True or False, nothing else (not 0 or 1, not a string)."""
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be True or False, got {value!r}")
    return value
