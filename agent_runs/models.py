"""Value types: rows of agent_runs and agent_run_attempts, statuses, transition results."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any, NamedTuple


class RunStatus(StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    CANCEL_REQUESTED = "cancel_requested"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset(
    {RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED, RunStatus.INTERRUPTED}
)


class AttemptOutcome(StrEnum):
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"
    INTERRUPTED = "interrupted"
    RETRY_RELEASED = "retry_released"
    LEASE_EXPIRED = "lease_expired"


@dataclass(frozen=True, slots=True)
class AgentRun:
    """One row of agent_runs: the current state of a run."""

    id: str
    request_id: str
    thread_id: str
    agent_slug: str
    uid: str
    run_type: str
    created_by_run_id: str | None
    status: RunStatus
    input_payload: dict[str, Any]
    error_type: str | None
    error_message: str | None
    worker_id: str | None
    heartbeat_at: datetime | None
    lease_expires_at: datetime | None
    manifest: dict[str, Any] | None
    manifest_fingerprint: str | None
    manifest_recorded_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    created_at: datetime
    updated_at: datetime
    # W3C traceparent/tracestate of the span that created the run (agent_runs.telemetry).
    trace_context: dict[str, str] | None = None
    # The run's result: a JSON value written by the transition that completed it (listings
    # leave it None: they never read it).
    output: Any = None
    # Claim order: the lowest priority (0-9) first, then the earliest available_at, then id.
    priority: int = 0
    # Claimable once available_at <= now; its creation time unless delayed.
    available_at: datetime | None = None
    # The key a concurrency limit applies to (agent_run_limits), None: never limited.
    concurrency_key: str | None = None

    def __post_init__(self) -> None:
        if type(self.status) is not RunStatus:
            object.__setattr__(self, "status", RunStatus(self.status))

    @property
    def is_terminal(self) -> bool:
        return self.status.is_terminal


@dataclass(frozen=True, slots=True)
class RunAttempt:
    """One row of agent_run_attempts: the immutable fact of one execution ownership."""

    id: int
    run_id: str
    attempt_no: int
    worker_id: str
    started_at: datetime
    heartbeat_at: datetime | None
    lease_expires_at: datetime | None
    finished_at: datetime | None
    outcome: AttemptOutcome | None
    error_type: str | None
    error_message: str | None
    created_at: datetime
    updated_at: datetime
    # The checkpoint this attempt resumed an earlier attempt's execution from, and its step.
    resumed_from: str | None = None
    resumed_step: int | None = None
    # When the transition that closed it scheduled the next attempt (None: it scheduled none).
    retry_at: datetime | None = None

    def __post_init__(self) -> None:
        if self.outcome is not None:
            object.__setattr__(self, "outcome", AttemptOutcome(self.outcome))

    @property
    def is_open(self) -> bool:
        return self.finished_at is None


class Claim(NamedTuple):
    """Result of mark_running: the run as it is now, and whether this call acquired it."""

    run: AgentRun | None
    acquired: bool


class ClaimedRun(NamedTuple):
    """Result of claim_next_attempt(s): the run as it is now, and the attempt_no it opened."""

    run: AgentRun
    attempt_no: int


class Finish(NamedTuple):
    """One run for finish_runs: its owner's terminal status and error classification."""

    run_id: str
    worker_id: str
    status: RunStatus | str
    error_type: str | None = None
    error_message: str | None = None
    # The run's result (a completed run's): any JSON value (see agent_runs.validation).
    output: Any = None


class Transition(NamedTuple):
    """Result of a guarded transition: the run as it is now, and whether this call changed it."""

    run: AgentRun | None
    changed: bool


class KeyLimit(NamedTuple):
    """One row of agent_run_limits as list_limits reads it: the key, its limit, its runs counted
    now (running, or cancel_requested with an owner) and its runs waiting (pending)."""

    concurrency_key: str
    max_running: int
    running: int
    waiting: int
