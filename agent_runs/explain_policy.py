"""The recovery policy's part of an explanation: a scheduled attempt, a requeue, and the
error types a policy ends a run with. Every user or agent value is escaped."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Final

from agent_runs.display import escape
from agent_runs.models import AttemptOutcome, RunAttempt
from agent_runs.policies import RunPolicy, RunRequeue

# The error types of a run the policy ended after a lost lease (its last attempt carries it).
EXHAUSTED_ERRORS: Final = frozenset(
    {"lost_leases_exhausted", "retries_exhausted", "deadline_exceeded"}
)


def requeued_between(
    requeues: Sequence[RunRequeue], earlier: RunAttempt, later: RunAttempt
) -> bool:
    """An operator's requeue lies between two attempts: it reopened the ended run."""
    ended = earlier.finished_at
    return ended is not None and any(ended <= q.requeued_at <= later.started_at for q in requeues)


def in_budget(attempts: Sequence[RunAttempt], requeues: Sequence[RunRequeue]) -> list[RunAttempt]:
    """The attempts started at or after the latest requeue (all of them without one)."""
    if not requeues:
        return list(attempts)
    since = max(q.requeued_at for q in requeues)
    return [a for a in attempts if a.started_at >= since]


def retried_text(
    attempts: Sequence[RunAttempt], requeues: Sequence[RunRequeue], policy: RunPolicy | None
) -> str:
    """`attempt 2 failed (rate_limited: …); attempt 3 of 5 not before 12:00:30Z`, from the
    last attempt's retry_at (a policy's decision)."""
    last = attempts[-1]
    budget = in_budget(attempts, requeues)
    n = len(budget)
    if last.outcome == AttemptOutcome.LEASE_EXPIRED:
        lost = sum(a.outcome == AttemptOutcome.LEASE_EXPIRED for a in budget)
        allowed = f" of {policy.max_lost_leases} allowed" if policy is not None else ""
        what = f"lost its lease ({lost}{allowed})"
    else:
        error = escape(f"{last.error_type}: {last.error_message}" if last.error_message else "")
        what = f"failed ({error or escape(last.error_type or 'no error recorded')})"
    of = f" of {policy.max_attempts}" if policy is not None else ""
    return (
        f"attempt {last.attempt_no} {what}; attempt {last.attempt_no + 1}"
        f"{of if n else ''} not before {clock(last.retry_at)}"
    )


def requeues_text(requeues: Sequence[RunRequeue]) -> str:
    """`; requeued at T (was failed: retries_exhausted; reason: …)` for each requeue."""
    parts = []
    for q in requeues:
        was = escape(q.previous_status)
        if q.previous_error_type:
            was += f": {escape(q.previous_error_type)}"
        reason = f"; reason: {escape(q.reason)}" if q.reason else ""
        parts.append(f"; requeued at {clock(q.requeued_at)} (was {was}{reason})")
    return "".join(parts)


def clock(value: datetime | None) -> str:
    """An instant as `2030-01-01T12:00:30Z` (UTC, to the second; milliseconds when set)."""
    if value is None:
        return "never"
    value = value.astimezone(UTC)
    text = value.strftime("%Y-%m-%dT%H:%M:%S")
    if value.microsecond:
        text += f".{value.microsecond // 1000:03d}"
    return text + "Z"
