"""Explain a run's current status from its attempt facts, or say exactly what does not fit.

Every value from a user or an agent (ids, owner tokens, errors) is escaped
(agent_runs.display.escape): the explanation is always one line of visible text.

Strict on purpose: every rule below is a state the repository's transitions can produce, and
anything else is reported unexplained (the chaos suite counts those and expects zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from itertools import pairwise
from typing import Final, NamedTuple

from agent_runs.display import escape
from agent_runs.explain_key import key_wait_text
from agent_runs.explain_policy import (
    EXHAUSTED_ERRORS,
    clock,
    requeued_between,
    requeues_text,
    retried_text,
)
from agent_runs.explain_resume import resumes_text
from agent_runs.models import AgentRun, AttemptOutcome, KeyLimit, RunAttempt, RunStatus
from agent_runs.policies import RunPolicy, RunRequeue

LEGACY: Final = "legacy: no facts recorded"
LEASE_EXPIRED_ERROR: Final = "worker_lease_expired"

# Outcomes after which the run may be claimed again (so another attempt may follow).
_REOPENING: Final = frozenset({AttemptOutcome.RETRY_RELEASED, AttemptOutcome.LEASE_EXPIRED})


class Explanation(NamedTuple):
    """One line about why the run is in its status; `explained` is False when the facts disagree."""

    explained: bool
    text: str


def explain_run(
    run: AgentRun,
    attempts: Sequence[RunAttempt],
    requeues: Sequence[RunRequeue] = (),
    policy: RunPolicy | None = None,
    *,
    key_limit: KeyLimit | None = None,
) -> Explanation:
    """Explain `run.status` from `attempts` (the run's whole history, any order) and its
    `requeues`; `policy` (the agent's current one) only adds "of N" to a scheduled attempt;
    `key_limit`, the limit of the run's concurrency key, says whether a waiting run waits for
    its key."""
    explanation = _explain(run, attempts, requeues, policy)
    waiting_for_key = key_wait_text(run, key_limit) if explanation.explained else None
    if waiting_for_key is None:
        return explanation
    return Explanation(True, explanation.text + waiting_for_key)


def _explain(
    run: AgentRun,
    attempts: Sequence[RunAttempt],
    requeues: Sequence[RunRequeue],
    policy: RunPolicy | None,
) -> Explanation:
    ordered = sorted(attempts, key=lambda a: a.attempt_no)
    requeued = sorted(requeues, key=lambda q: (q.requeued_at, q.id))
    problem = _shape_problem(run) or _history_problem(run, ordered, requeued)
    if problem is not None:
        return _unexplained(run, problem)
    if not ordered and run.started_at is not None and not requeued:
        return Explanation(
            True,
            f"{LEGACY} (run is {run.status}; it started {_ts(run.started_at)}, "
            "before attempts were recorded)",
        )
    if run.status == RunStatus.PENDING and requeued:
        last_requeue = requeued[-1].requeued_at
        if not ordered or ordered[-1].finished_at is None or ordered[-1].started_at < last_requeue:
            return _ok(run, "waiting for its first attempt since its requeue", ordered, requeued)
    if run.status == RunStatus.PENDING and ordered and ordered[-1].retry_at is not None:
        return _ok(run, retried_text(ordered, requeued, policy), ordered, requeued)
    explained = _STATUS_RULES[run.status](run, ordered)
    if explained.explained and requeued:
        return Explanation(True, explained.text + requeues_text(requeued))
    return explained


# -- structure: what must hold whatever the status -------------------------------------------


def _shape_problem(run: AgentRun) -> str | None:
    lease = (run.worker_id, run.heartbeat_at, run.lease_expires_at)
    if any(v is None for v in lease) and any(v is not None for v in lease):
        return "its lease columns are partly set"
    if run.is_terminal:
        if run.finished_at is None:
            return "a terminal run has no finished_at"
        if run.worker_id is not None:
            return f"a terminal run still has an owner ({escape(run.worker_id)})"
    elif run.finished_at is not None:
        return f"a non-terminal run has finished_at {_ts(run.finished_at)}"
    if run.status == RunStatus.RUNNING and run.worker_id is None:
        return "a running run has no owner"
    if run.status == RunStatus.PENDING and run.worker_id is not None:
        return f"a pending run has an owner ({escape(run.worker_id)})"
    return None


def _history_problem(
    run: AgentRun, attempts: list[RunAttempt], requeues: Sequence[RunRequeue] = ()
) -> str | None:
    numbers = [a.attempt_no for a in attempts]
    if numbers != list(range(1, len(attempts) + 1)):
        return f"attempt numbers are {numbers}, expected 1..{len(attempts)}"
    for attempt in attempts:
        if attempt.run_id != run.id:
            return f"attempt {attempt.attempt_no} belongs to run {escape(attempt.run_id)}"
        if (attempt.outcome is None) != (attempt.finished_at is None):
            return f"attempt {attempt.attempt_no} has only one of outcome and finished_at"
        if attempt.finished_at is not None and attempt.finished_at < attempt.started_at:
            return f"attempt {attempt.attempt_no} finished before it started"
    for earlier, later in pairwise(attempts):
        if earlier.finished_at is None:
            return (
                f"attempt {earlier.attempt_no} is still open but attempt {later.attempt_no} exists"
            )
        if earlier.outcome not in _REOPENING and not requeued_between(requeues, earlier, later):
            return (
                f"attempt {earlier.attempt_no} ended {earlier.outcome}, "
                f"yet attempt {later.attempt_no} followed"
            )
        if later.started_at < earlier.finished_at:
            return (
                f"attempt {later.attempt_no} started before attempt {earlier.attempt_no} "
                "finished (two owners at once)"
            )
    if not attempts:
        return None
    first, last = attempts[0], attempts[-1]
    if run.started_at is None:
        return "it has attempts but no started_at"
    if run.started_at > first.started_at:
        return "its started_at is later than its first attempt's"
    if last.finished_at is None:
        if run.status not in (RunStatus.RUNNING, RunStatus.CANCEL_REQUESTED):
            return f"attempt {last.attempt_no} is still open on a {run.status} run"
        if run.worker_id != last.worker_id:
            return (
                f"open attempt {last.attempt_no} belongs to {escape(last.worker_id)} "
                f"but the run's owner is {escape(run.worker_id)}"
            )
    elif run.worker_id is not None:
        return f"the run is owned by {escape(run.worker_id)} but no attempt is open"
    if run.finished_at and last.finished_at and last.finished_at > run.finished_at:
        return f"attempt {last.attempt_no} finished after the run did"
    return None


# -- one rule per status ---------------------------------------------------------------------


def _ended_by(
    run: AgentRun, attempts: list[RunAttempt], outcome: AttemptOutcome, verb: str
) -> RunAttempt | Explanation:
    """The last attempt when it ended with `outcome`; else why the run is unexplained."""
    if not attempts:
        return _unexplained(run, f"no attempt {verb} it")
    last = attempts[-1]
    if last.outcome != outcome:
        return _unexplained(run, f"last attempt {last.attempt_no} ended {last.outcome}")
    return last


def _completed(run: AgentRun, attempts: list[RunAttempt]) -> Explanation:
    last = _ended_by(run, attempts, AttemptOutcome.COMPLETED, "completed")
    if isinstance(last, Explanation):
        return last
    return _ok(run, f"attempt {last.attempt_no} by {escape(last.worker_id)} completed it", attempts)


def _failed(run: AgentRun, attempts: list[RunAttempt]) -> Explanation:
    error = _error(run.error_type, run.error_message)
    if not attempts:
        return _ok(run, f"failed while pending, before any attempt: {error}", attempts)
    last = attempts[-1]
    if last.outcome == AttemptOutcome.FAILED:
        if last.error_type != run.error_type:
            return _unexplained(
                run,
                f"attempt {last.attempt_no} failed with {last.error_type!r} "
                f"but the run with {run.error_type!r}",
            )
        return _ok(
            run, f"attempt {last.attempt_no} by {escape(last.worker_id)} failed: {error}", attempts
        )
    if last.outcome == AttemptOutcome.LEASE_EXPIRED and run.error_type in EXHAUSTED_ERRORS:
        if last.error_type != run.error_type:
            return _unexplained(
                run,
                f"attempt {last.attempt_no} ended lease_expired with {last.error_type!r} "
                f"but the run with {run.error_type!r}",
            )
        decision = escape((run.error_message or "").split(". ", 1)[0])
        return _ok(run, f"{decision} ({escape(run.error_type or '')})", attempts)
    if last.outcome == AttemptOutcome.LEASE_EXPIRED:
        if run.error_type != LEASE_EXPIRED_ERROR or last.error_type != LEASE_EXPIRED_ERROR:
            return _unexplained(
                run,
                f"attempt {last.attempt_no} ended lease_expired but the run's error is "
                f"{run.error_type!r}, expected {LEASE_EXPIRED_ERROR!r}",
            )
        return _ok(
            run,
            f"attempt {last.attempt_no} by {escape(last.worker_id)} lost its lease "
            f"(last heartbeat {_ts(last.heartbeat_at)}) and the reconciler failed the run: "
            "result unknown, check side effects (at-least-once)",
            attempts,
        )
    if last.outcome == AttemptOutcome.RETRY_RELEASED:
        if run.error_type == LEASE_EXPIRED_ERROR:
            how = "then cancel was requested while no worker owned it and the reconciler failed it"
        else:
            how = f"then it was failed while pending: {error}"
        return _ok(run, f"attempt {last.attempt_no} was released for retry, {how}", attempts)
    return _unexplained(
        run, f"a failed run must end in a failed or lease_expired attempt, not {last.outcome}"
    )


def _cancelled(run: AgentRun, attempts: list[RunAttempt]) -> Explanation:
    if not attempts:
        return _ok(run, "cancelled before it ever started (no attempt)", attempts)
    last = attempts[-1]
    if last.outcome == AttemptOutcome.CANCELLED:
        return _ok(
            run,
            f"attempt {last.attempt_no} by {escape(last.worker_id)} stopped on the cancel request",
            attempts,
        )
    if last.outcome == AttemptOutcome.RETRY_RELEASED:
        return _ok(
            run,
            f"attempt {last.attempt_no} was released for retry, then it was cancelled",
            attempts,
        )
    return _unexplained(run, f"a cancelled run must end in a cancelled attempt, not {last.outcome}")


def _interrupted(run: AgentRun, attempts: list[RunAttempt]) -> Explanation:
    last = _ended_by(run, attempts, AttemptOutcome.INTERRUPTED, "interrupted")
    if isinstance(last, Explanation):
        return last
    if last.error_type != run.error_type:
        return _unexplained(
            run,
            f"attempt {last.attempt_no} was interrupted with {last.error_type!r} "
            f"but the run with {run.error_type!r}",
        )
    error = _error(run.error_type, run.error_message)
    return _ok(
        run,
        f"attempt {last.attempt_no} by {escape(last.worker_id)} was interrupted: {error}",
        attempts,
    )


def _pending(run: AgentRun, attempts: list[RunAttempt]) -> Explanation:
    if not attempts:
        return _ok(run, "waiting for its first attempt", attempts)
    last = attempts[-1]
    if last.outcome != AttemptOutcome.RETRY_RELEASED:
        return _unexplained(
            run,
            f"a pending run's last attempt must be retry_released (or carry retry_at), "
            f"not {last.outcome}",
        )
    return _ok(
        run,
        f"attempt {last.attempt_no} was released for retry; attempt {last.attempt_no + 1} "
        "will follow",
        attempts,
    )


def _running(run: AgentRun, attempts: list[RunAttempt]) -> Explanation:
    if not attempts:
        return _unexplained(run, "a running run without started_at")
    last = attempts[-1]
    return _ok(
        run,
        f"attempt {last.attempt_no} by {escape(last.worker_id)} holds the lease "
        f"until {_ts(run.lease_expires_at)}",
        attempts,
    )


def _cancel_requested(run: AgentRun, attempts: list[RunAttempt]) -> Explanation:
    if not attempts:
        return _unexplained(run, "cancel was requested but it never started (no started_at)")
    last = attempts[-1]
    if last.finished_at is None:
        return _ok(
            run,
            f"attempt {last.attempt_no} by {escape(last.worker_id)} has yet to stop "
            f"(lease until {_ts(run.lease_expires_at)})",
            attempts,
        )
    if last.outcome != AttemptOutcome.RETRY_RELEASED:
        return _unexplained(
            run,
            f"an ownerless cancel_requested run's last attempt must be retry_released, "
            f"not {last.outcome}",
        )
    return _ok(
        run,
        f"attempt {last.attempt_no} was released for retry, then cancel was requested; "
        "the next claimer finishes it cancelled",
        attempts,
    )


_STATUS_RULES: Final = {
    RunStatus.COMPLETED: _completed,
    RunStatus.FAILED: _failed,
    RunStatus.CANCELLED: _cancelled,
    RunStatus.INTERRUPTED: _interrupted,
    RunStatus.PENDING: _pending,
    RunStatus.RUNNING: _running,
    RunStatus.CANCEL_REQUESTED: _cancel_requested,
}


# -- text ------------------------------------------------------------------------------------


def _ok(
    run: AgentRun,
    reason: str,
    attempts: list[RunAttempt],
    requeues: Sequence[RunRequeue] = (),
) -> Explanation:
    earlier = summarize_attempts(attempts[:-1])
    suffix = f" (earlier: {earlier})" if earlier else ""
    said = f"{run.status}: {reason}{suffix}{resumes_text(attempts)}{requeues_text(requeues)}"
    return Explanation(True, said)


# Consecutive attempts alike (same outcome and error type) from this many on are one entry.
SUMMARY_RUN: Final = 3


def summarize_attempts(attempts: Sequence[RunAttempt]) -> str:
    """An attempt history in one short line: `#1 retry_released, #2 lease_expired`; a run of
    SUMMARY_RUN or more consecutive attempts alike as one entry with its error type,
    `#1–#118 retry_released (rate_limited)`, so a long history stays readable."""
    groups: list[list[RunAttempt]] = []
    for attempt in attempts:
        last = groups[-1][-1] if groups else None
        if last is not None and (last.outcome, last.error_type) == (
            attempt.outcome,
            attempt.error_type,
        ):
            groups[-1].append(attempt)
        else:
            groups.append([attempt])
    parts: list[str] = []
    for group in groups:
        first, last = group[0], group[-1]
        if len(group) < SUMMARY_RUN:
            parts += [f"#{a.attempt_no} {a.outcome}" for a in group]
            continue
        cause = f" ({escape(first.error_type)})" if first.error_type else ""
        parts.append(f"#{first.attempt_no}–#{last.attempt_no} {first.outcome}{cause}")
    return ", ".join(parts)


def _unexplained(run: AgentRun, problem: str) -> Explanation:
    return Explanation(False, f"unexplained: {run.status} run {escape(run.id)}: {problem}")


def _error(error_type: str | None, message: str | None) -> str:
    if error_type and message:
        return f"{escape(error_type)}: {escape(message)}"
    return escape(error_type or message or "no error recorded")


def _ts(value: datetime | None) -> str:
    return clock(value)  # one time format in every explanation: 2030-01-01T12:00:30.250Z
