"""Numbers: seconds and integers in range, checked before any conversion (no OverflowError)."""

from __future__ import annotations

import math

from agent_runs.errors import InvalidArgument
from agent_runs.validation.limits import (
    MAX_LEASE_SECONDS,
    MAX_LIMIT,
    MAX_RUNNING_LIMIT,
    MAX_TIMEOUT_SECONDS,
)
from agent_runs.validation.text import shown


def finite_number(
    name: str, value: object, low: float, high: float, *, low_allowed: bool = False
) -> float:
    """A finite number with low < value <= high (low <= value with `low_allowed`), as a float
    (bool and huge ints refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{name} must be a number, got {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    above_low = low <= seconds if low_allowed else low < seconds
    if not math.isfinite(seconds) or not above_low or not seconds <= high:
        got = f"{type(value).__name__} out of range" if seconds == math.inf else repr(seconds)
        sign = ">=" if low_allowed else ">"
        raise InvalidArgument(f"{name} must be finite, {sign} {low:g} and <= {high:g}, got {got}")
    return seconds


def timeout_seconds(value: object, name: str = "timeout_seconds") -> float:
    """How long a call may wait: a finite number, 0 <= x <= MAX_TIMEOUT_SECONDS."""
    return finite_number(name, value, 0, MAX_TIMEOUT_SECONDS, low_allowed=True)


def every_seconds(value: object, name: str = "--every") -> float:
    """A repeating command's period: a finite number, 0 < x <= 86400."""
    return finite_number(name, value, 0, MAX_LEASE_SECONDS)


def lease_seconds(value: object) -> float:
    return finite_number("lease_seconds", value, 0, MAX_LEASE_SECONDS)


def integer(name: str, value: object, low: int, high: int) -> int:
    """An int (not a bool) with low <= value <= high."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidArgument(f"{name} must be an integer from {low} to {high}, got {shown(value)}")
    return int(value)


def limit(value: object) -> int:
    return integer("limit", value, 1, MAX_LIMIT)


def max_running(value: object) -> int:
    """A concurrency limit: how many runs of a key may be counted at once (0 pauses the key)."""
    return integer("max_running", value, 0, MAX_RUNNING_LIMIT)
