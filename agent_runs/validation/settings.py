"""A worker's settings: name, heartbeat, tries, poll, completion mode, listen DSN."""

from __future__ import annotations

from typing import Final

from agent_runs.errors import InvalidArgument
from agent_runs.validation.limits import (
    MAX_DSN_LENGTH,
    MAX_POLL_SECONDS,
    MAX_TRIES,
    MAX_WORKER_NAME_LENGTH,
)
from agent_runs.validation.numbers import _seconds, integer
from agent_runs.validation.text import _shown, _text

COMPLETIONS: Final = ("durable", "async")


def completion(value: object) -> str:
    """How a worker writes a run's end: `durable` (counted done once committed) or `async`."""
    if not isinstance(value, str) or value not in COMPLETIONS:
        raise InvalidArgument(f"completion must be 'durable' or 'async', got {_shown(value)}")
    return value


def worker_name(value: object) -> str:
    """A worker's stable name: 1-95 characters, so that `name:<32 hex>` fits a worker_id."""
    return _text("name", value, MAX_WORKER_NAME_LENGTH)


def heartbeat_seconds(value: object, lease_seconds_: float) -> float:
    """Seconds between renewals (lease_seconds already checked): 0 < x < lease_seconds.

    None means a third of the lease.
    """
    if value is None:
        return lease_seconds_ / 3
    seconds = _seconds("heartbeat_seconds", value, 0, lease_seconds_)
    if seconds >= lease_seconds_:
        raise InvalidArgument(
            f"heartbeat_seconds must be below lease_seconds ({lease_seconds_:g}), got {seconds:g}"
        )
    return seconds


def max_tries(value: object) -> int:
    return integer("max_tries", value, 1, MAX_TRIES)


def poll_seconds(value: object) -> float:
    return _seconds("poll_seconds", value, 0, MAX_POLL_SECONDS)


def optional_dsn(name: str, value: object) -> str | None:
    """A connection string (URL or key=value) or None; libpq parses it when it connects."""
    if value is None:
        return None
    return _text(name, value, MAX_DSN_LENGTH)
