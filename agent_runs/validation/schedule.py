"""Scheduling and recovery policy: priority, available_at, retry_after_seconds, a requeue's
reason and a policy's fields, each refused by name before any SQL."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Final

from agent_runs.errors import InvalidArgument
from agent_runs.validation.limits import MAX_TRIES, TIME_MAX
from agent_runs.validation.numbers import finite_number, integer
from agent_runs.validation.text import bounded_text, identifier
from agent_runs.validation.times import instant

MAX_PRIORITY: Final = 9
# The longest delay a retry or a policy's back-off may set: a year.
MAX_DELAY_SECONDS: Final = 365 * 86400
# The longest deadline a policy may set: ten years.
MAX_DEADLINE_SECONDS: Final = 3650 * 86400
MAX_REASON_LENGTH: Final = 1000
DEFAULT_POLICY_SLUG: Final = "*"


def priority(value: object) -> int:
    """A run's priority: an int from 0 (claimed first) to 9."""
    return integer("priority", value, 0, MAX_PRIORITY)


def available_at(value: object) -> datetime | None:
    """When a new run becomes claimable: None (now), or an aware datetime inside the window."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidArgument(
            f"available_at must be a datetime or None, got {type(value).__name__}"
        )
    utc = instant("available_at", value)
    return datetime(
        utc.year, utc.month, utc.day, utc.hour, utc.minute, utc.second, utc.microsecond, UTC
    )


def retry_after_seconds(value: object, at: datetime | None = None) -> float | None:
    """A delay before the next attempt: None, or a finite number 0 <= x <= a year; with a
    given `now` (`at`), now + delay must lie inside the window."""
    if value is None:
        return None
    seconds = finite_number("retry_after_seconds", value, 0, MAX_DELAY_SECONDS, low_allowed=True)
    if at is not None and at + timedelta(seconds=seconds) >= TIME_MAX:
        raise InvalidArgument(f"now + retry_after_seconds must be before {TIME_MAX} UTC")
    return seconds


def reason(value: object) -> str | None:
    """An operator's reason for a requeue: None, or 1-1000 characters of text without NUL."""
    return None if value is None else bounded_text("reason", value, MAX_REASON_LENGTH)


def policy_slug(value: object) -> str:
    """The agent slug a policy is for ('*' = the default for slugs without one)."""
    if value == DEFAULT_POLICY_SLUG:
        return DEFAULT_POLICY_SLUG
    return identifier("agent_slug", value)


def max_attempts(value: object) -> int:
    return integer("max_attempts", value, 1, MAX_TRIES)


def max_lost_leases(value: object) -> int:
    return integer("max_lost_leases", value, 0, MAX_TRIES)


def backoff_seconds(value: object, name: str = "backoff_seconds") -> float:
    return finite_number(name, value, 0, MAX_DELAY_SECONDS, low_allowed=True)


def backoff_jitter(value: object) -> float:
    return finite_number("backoff_jitter", value, 0, 1, low_allowed=True)


def deadline_seconds(value: object) -> float | None:
    """None (no deadline), or a finite number 0 < x <= ten years."""
    return (
        None if value is None else finite_number("deadline_seconds", value, 0, MAX_DEADLINE_SECONDS)
    )
