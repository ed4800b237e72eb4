"""Durations written `90s`, `15m`, `2h`, `7d`, and ISO 8601 timestamps, for operators' input."""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from typing import Final

from agent_runs.errors import InvalidArgument

_DURATION: Final = re.compile(r"([0-9]{1,9})([smhd])")
_UNIT_SECONDS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}
# A window longer than this is certainly a typo (and would leave the timestamp range).
MAX_DURATION: Final = timedelta(days=36500)


def parse_duration(name: str, text: str) -> timedelta:
    """`90s`, `15m`, `2h` or `7d` as a timedelta (> 0, at most 100 years)."""
    match = _DURATION.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
        raise InvalidArgument(f"{name} must be a duration such as 90s, 15m, 2h or 7d, got {text!r}")
    value = timedelta(seconds=int(match.group(1)) * _UNIT_SECONDS[match.group(2)])
    if not timedelta(0) < value <= MAX_DURATION:
        raise InvalidArgument(f"{name} must be more than 0 and at most 36500d, got {text!r}")
    return value


def parse_timestamp(name: str, text: str) -> datetime:
    """An ISO 8601 timestamp with a UTC offset (`Z` or `+02:00`); naive ones are ambiguous."""
    try:
        value = datetime.fromisoformat(text.strip())
    except (TypeError, ValueError):
        raise InvalidArgument(f"{name} must be an ISO 8601 timestamp, got {text!r}") from None
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgument(
            f"{name} must carry a UTC offset (e.g. 2030-01-01T12:00:00Z), got {text!r}"
        )
    return value


def parse_since(name: str, text: str) -> datetime | timedelta:
    """A duration back from now (`2h`) or an ISO 8601 timestamp."""
    if isinstance(text, str) and _DURATION.fullmatch(text.strip()):
        return parse_duration(name, text)
    if isinstance(text, str) and text.strip()[:1].isdigit() and "-" in text:
        return parse_timestamp(name, text)
    raise InvalidArgument(
        f"{name} must be a duration (90s, 15m, 2h, 7d) or an ISO 8601 timestamp, got {text!r}"
    )


def format_duration(value: timedelta) -> str:
    """A short human form: 42s, 3m12s, 5h03m, 2d04h."""
    seconds = max(0, int(value.total_seconds()))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d{hours:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"
