"""agent_runs: durable agent runs, leases and an immutable attempt history on PostgreSQL."""

from __future__ import annotations

from importlib import metadata

from agent_runs import aio  # the asyncio face: agent_runs.aio.connect, ...
from agent_runs.db import connect, create_pool
from agent_runs.errors import AgentRunsError, InvalidArgument, NotLeaseOwner, ThreadBusy
from agent_runs.fingerprint import manifest_fingerprint
from agent_runs.models import (
    AgentRun,
    AttemptOutcome,
    Claim,
    ClaimedRun,
    Finish,
    KeyLimit,
    RunAttempt,
    RunStatus,
    Transition,
)
from agent_runs.notify import CLAIMABLE_CHANNEL, FINISHED_CHANNEL, wait_for_run
from agent_runs.policies import RunPolicy, RunRequeue
from agent_runs.repository import AgentRunRepository
from agent_runs.repository.operator_queries import (
    AttemptDurations,
    PruneBatch,
    QueueNow,
    RunListing,
    RunStats,
    RunSummary,
    WorkerStats,
    runs_cursor,
)

try:
    __version__ = metadata.version("agent_runs")
except metadata.PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "CLAIMABLE_CHANNEL",
    "FINISHED_CHANNEL",
    "AgentRun",
    "AgentRunRepository",
    "AgentRunsError",
    "AttemptDurations",
    "AttemptOutcome",
    "Claim",
    "ClaimedRun",
    "Finish",
    "InvalidArgument",
    "KeyLimit",
    "NotLeaseOwner",
    "PruneBatch",
    "QueueNow",
    "RunAttempt",
    "RunListing",
    "RunPolicy",
    "RunRequeue",
    "RunStats",
    "RunStatus",
    "RunSummary",
    "ThreadBusy",
    "Transition",
    "WorkerStats",
    "aio",
    "connect",
    "create_pool",
    "manifest_fingerprint",
    "runs_cursor",
    "wait_for_run",
]
