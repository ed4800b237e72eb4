"""Input checks that run before any SQL: a bad argument is refused by name, nothing is written."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any, Final

from agent_runs.errors import InvalidArgument
from agent_runs.models import TERMINAL_STATUSES, RunStatus

MAX_ID_LENGTH: Final = 64
MAX_WORKER_ID_LENGTH: Final = 128
MAX_ERROR_TYPE_LENGTH: Final = 64
MAX_ERROR_MESSAGE_LENGTH: Final = 8192
MAX_LEASE_SECONDS: Final = 86400
RUN_TYPES: Final = frozenset({"chat", "resume", "subagent"})
_HEX = frozenset("0123456789abcdef")


def _text(name: str, value: object, max_length: int) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidArgument(f"{name} must not be empty")
    if len(value) > max_length:
        raise InvalidArgument(f"{name} must be at most {max_length} characters, got {len(value)}")
    if "\x00" in value:
        raise InvalidArgument(f"{name} must not contain NUL characters")
    return value


def identifier(name: str, value: object) -> str:
    """run_id, request_id, thread_id, uid, agent_slug, created_by_run_id: 1-64 chars, no NUL."""
    return _text(name, value, MAX_ID_LENGTH)


def optional_identifier(name: str, value: object) -> str | None:
    return None if value is None else identifier(name, value)


def worker_id(value: object, name: str = "worker_id") -> str:
    return _text(name, value, MAX_WORKER_ID_LENGTH)


def optional_worker_id(value: object) -> str | None:
    return None if value is None else worker_id(value)


def lease_seconds(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"lease_seconds must be a number, got {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds) or not 0 < seconds <= MAX_LEASE_SECONDS:
        raise InvalidArgument(
            f"lease_seconds must be finite, > 0 and <= {MAX_LEASE_SECONDS}, got {value!r}"
        )
    return seconds


def now(value: object) -> datetime | None:
    """An injected clock must be timezone-aware; None means the database's now()."""
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidArgument(f"now must be a datetime or None, got {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidArgument("now must be timezone-aware (naive datetimes are ambiguous)")
    return value


def terminal_status(value: object) -> RunStatus:
    try:
        status = RunStatus(value) if isinstance(value, str) else RunStatus(repr(value))
    except ValueError:
        raise InvalidArgument(f"status must be a run status, got {value!r}") from None
    if status not in TERMINAL_STATUSES:
        terminal = ", ".join(sorted(TERMINAL_STATUSES))
        raise InvalidArgument(f"status must be terminal ({terminal}), got {status.value!r}")
    return status


def error_type(value: object) -> str | None:
    if value is None:
        return None
    return _text("error_type", value, MAX_ERROR_TYPE_LENGTH)


def error_message(value: object) -> str | None:
    """Never refused: a failure fact is kept, cleaned (NUL -> U+FFFD) and cut with a marker."""
    if value is None:
        return None
    text = (value if isinstance(value, str) else str(value)).replace("\x00", "\ufffd")
    if len(text) > MAX_ERROR_MESSAGE_LENGTH:
        cut = len(text) - MAX_ERROR_MESSAGE_LENGTH
        text = f"{text[:MAX_ERROR_MESSAGE_LENGTH]} … [truncated {cut} characters]"
    return text


def fingerprint(value: object) -> str:
    if not isinstance(value, str) or len(value) != 64 or not _HEX.issuperset(value):
        raise InvalidArgument("fingerprint must be 64 lowercase hex characters (SHA-256)")
    return value


def json_object(name: str, value: object) -> dict[str, Any]:
    """A dict that serializes to strict JSON (no NaN/Infinity, which jsonb refuses)."""
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{name} must be a JSON object (dict), got {type(value).__name__}")
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"{name} must be JSON-serializable: {exc}") from None
    return dict(value)


def run_type(value: object) -> str:
    if value not in RUN_TYPES:
        raise InvalidArgument(f"run_type must be one of {sorted(RUN_TYPES)}, got {value!r}")
    return str(value)


def agent_slugs(value: object) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise InvalidArgument("agent_slugs must be a list of agent slugs or None")
    slugs = [identifier("agent_slugs", slug) for slug in value]
    if not slugs:
        raise InvalidArgument("agent_slugs must not be empty (use None for every agent)")
    return slugs


def limit(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100_000:
        raise InvalidArgument(f"limit must be an integer from 1 to 100000, got {value!r}")
    return value


def leases(value: object) -> tuple[list[str], list[str]]:
    """renew_leases: a mapping run_id -> worker_id, returned as two parallel lists."""
    if not isinstance(value, Mapping):
        raise InvalidArgument("leases must be a mapping of run_id to worker_id")
    run_ids = [identifier("leases run_id", run_id) for run_id in value]
    worker_ids = [worker_id(owner, "leases worker_id") for owner in value.values()]
    return run_ids, worker_ids
