"""The keyset cursor of a page of runs: (created_at, id) of its last run, opaque to callers."""

from __future__ import annotations

import base64
import binascii
import json
from datetime import UTC, datetime
from typing import Protocol

from agent_runs import validation as check
from agent_runs.errors import InvalidArgument


class Listed(Protocol):
    """What a cursor is made of: an AgentRun or a RunListing."""

    @property
    def id(self) -> str: ...

    @property
    def created_at(self) -> datetime: ...


def runs_cursor(run: Listed) -> str:
    """The keyset cursor after `run`: pass it as `before` to get the next (older) page."""
    return keyset_cursor(run.created_at, run.id)


def keyset_cursor(at: datetime, run_id: str) -> str:
    """The cursor of a keyset position (a time, then a run id), as `decode_cursor` reads it."""
    raw = json.dumps([at.astimezone(UTC).isoformat(), run_id])
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def decode_cursor(value: object) -> tuple[datetime, str]:
    bad = InvalidArgument("before must be a cursor given by a previous page of runs")
    if not isinstance(value, str) or not 0 < len(value) <= 512:
        raise bad
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        created, run_id = json.loads(raw)
        created_at = datetime.fromisoformat(created)
    except (binascii.Error, ValueError, TypeError):
        raise bad from None
    if created_at.tzinfo is None or not isinstance(run_id, str):
        raise bad
    return created_at, check.identifier("before", run_id)
