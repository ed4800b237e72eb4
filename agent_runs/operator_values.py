"""The typed values of the operator's queries (agent_runs.repository.operator_queries)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TypedDict

from agent_runs.models import AgentRun, RunStatus


class RunFilters(TypedDict, total=False):
    """The filters of `list_runs`, by keyword."""

    statuses: Iterable[RunStatus | str] | None
    agent_slug: str | None
    thread_id: str | None
    uid: str | None
    worker: str | None
    since: datetime | timedelta | None
    stuck: bool
    stuck_after: timedelta
    limit: int
    before: str | None
    now: datetime | None
    concurrency_key: str | None


@dataclass(frozen=True, slots=True)
class RunSummary:
    """A run as listed: the run, how many attempts it has, and its last attempt's owner."""

    run: AgentRun
    attempt_count: int
    last_worker_id: str | None


@dataclass(frozen=True, slots=True)
class RunListing:
    """A run as a runs table shows it: no payload, manifest, error message or trace context."""

    id: str
    status: RunStatus
    agent_slug: str
    thread_id: str
    uid: str
    created_at: datetime
    error_type: str | None
    attempt_count: int
    last_worker_id: str | None


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One worker identity's attempts finished in the window, by what became of them."""

    worker: str
    attempts: int
    completions: int
    failures: int
    lease_losses: int
    retries: int


@dataclass(frozen=True, slots=True)
class AttemptDurations:
    """Seconds from start to finish of the attempts finished in the window."""

    p50: float
    p95: float
    max: float


@dataclass(frozen=True, slots=True)
class QueueNow:
    """The queue at the moment of the call, whatever the window."""

    pending: int
    oldest_pending_age: timedelta | None
    running: int
    expired_unreconciled: int


@dataclass(frozen=True, slots=True)
class RunStats:
    """run_stats: the window [window_start, now] (window_start None: all history)."""

    window_start: datetime | None
    now: datetime
    runs_by_status: Mapping[str, int]
    attempts_by_outcome: Mapping[str, int]
    top_error_types: Mapping[str, int]
    workers: tuple[WorkerStats, ...]
    durations: AttemptDurations | None
    queue: QueueNow


@dataclass(frozen=True, slots=True)
class PruneBatch:
    """One batch of prune_finished_runs: what went (or would go, in a dry run)."""

    runs: int
    attempts: int
    examined: int
    cutoff: datetime
