"""Exceptions raised by agent_runs, and the database constraint names code recognises."""

from __future__ import annotations

from typing import Final

import psycopg

# Constraint names the repository translates into domain errors (see migrations/).
UQ_ONE_ACTIVE_PER_THREAD: Final = "uq_agent_runs_one_active_per_thread"
UQ_REQUEST_ID: Final = "uq_agent_runs_request_id"
UQ_RUN_ATTEMPT_NO: Final = "uq_agent_run_attempts_run_attempt_no"
UQ_ONE_OPEN_ATTEMPT: Final = "uq_agent_run_attempts_one_open_per_run"


class AgentRunsError(Exception):
    """Base class of every error agent_runs raises on purpose."""


class InvalidArgument(AgentRunsError, ValueError):
    """An argument is malformed; raised before any SQL runs, so nothing was written."""


class NotLeaseOwner(AgentRunsError, ValueError):
    """The caller does not hold a live lease on the run it tried to change."""


class ThreadBusy(AgentRunsError):
    """Another non-terminal run already exists on the same (uid, agent_slug, thread_id)."""


class RetryableError(Exception):
    """Raised by an agent for a transient failure: the run's recovery policy decides whether
    and when another attempt runs (`retry_after_seconds`: not before this delay, e.g. a
    provider's Retry-After; capped by the policy's backoff_max_seconds)."""

    def __init__(self, *args: object, retry_after_seconds: float | None = None) -> None:
        super().__init__(*args)
        self.retry_after_seconds = retry_after_seconds


class LeaseLost(NotLeaseOwner):
    """The worker can no longer prove it holds the run's lease; the agent should stop."""


# Failures of the database or of the way to it: callers log them, back off and reconnect.
# (psycopg_pool's PoolTimeout and TooManyRequests are OperationalErrors.)
DB_ERRORS: Final = (psycopg.OperationalError, psycopg.InterfaceError)
