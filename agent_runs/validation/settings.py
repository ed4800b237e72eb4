"""Settings: a worker's (name, heartbeat, tries, poll, completion mode, listen DSN) and the
dashboard's token."""

from __future__ import annotations

from typing import Final

from agent_runs.errors import InvalidArgument
from agent_runs.validation.limits import (
    MAX_DSN_LENGTH,
    MAX_POLL_SECONDS,
    MAX_TRIES,
    MAX_WORKER_NAME_LENGTH,
)
from agent_runs.validation.numbers import finite_number, integer
from agent_runs.validation.text import bounded_text, shown

COMPLETIONS: Final = ("durable", "async")
# A dashboard token that is typed in: printable, and not so short that a few guesses find it.
MIN_TOKEN_LENGTH: Final = 8


def completion(value: object) -> str:
    """How a worker writes a run's end: `durable` (counted done once committed) or `async`."""
    if not isinstance(value, str) or value not in COMPLETIONS:
        raise InvalidArgument(f"completion must be 'durable' or 'async', got {shown(value)}")
    return value


def worker_name(value: object) -> str:
    """A worker's stable name: 1-95 characters, so that `name:<32 hex>` fits a worker_id."""
    return bounded_text("name", value, MAX_WORKER_NAME_LENGTH)


def heartbeat_seconds(value: object, lease_seconds_: float) -> float:
    """Seconds between renewals (lease_seconds already checked): 0 < x < lease_seconds.

    None means a third of the lease.
    """
    if value is None:
        return lease_seconds_ / 3
    seconds = finite_number("heartbeat_seconds", value, 0, lease_seconds_)
    if seconds >= lease_seconds_:
        raise InvalidArgument(
            f"heartbeat_seconds must be below lease_seconds ({lease_seconds_:g}), got {seconds:g}"
        )
    return seconds


def max_tries(value: object) -> int:
    return integer("max_tries", value, 1, MAX_TRIES)


def poll_seconds(value: object) -> float:
    return finite_number("poll_seconds", value, 0, MAX_POLL_SECONDS)


def optional_dsn(name: str, value: object) -> str | None:
    """A connection string (URL or key=value) or None; libpq parses it when it connects."""
    if value is None:
        return None
    return bounded_text(name, value, MAX_DSN_LENGTH)


def dashboard_token(value: object, name: str = "token") -> str | None:
    """None (no token), or the dashboard's token: a printable str of at least 8 characters."""
    if value is None:
        return None
    if not isinstance(value, str) or len(value) < MIN_TOKEN_LENGTH or not value.isprintable():
        raise InvalidArgument(
            f"{name} must be a printable string of at least {MIN_TOKEN_LENGTH} characters"
        )
    return value
