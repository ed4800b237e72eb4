"""What to write for a run once its agent has returned or raised: a pure decision.

In order: a cancel request -> `cancelled`; the agent raised SystemExit or KeyboardInterrupt ->
`interrupted` (error_type `agent_exit`; the worker then stops); the worker is shutting down ->
released for retry unless the agent returned `completed`; RetryableError -> released while
attempt_no < max_tries (the attempt keeps `retryable_error` and its text), else `failed` /
`retries_exhausted` (either way written by retry_or_fail, whose policy decides with the
worker's max_tries as a cap); any other exception -> `failed` / `agent_error`; a value that is
not a valid AgentResult -> `failed` / `agent_error`, saying what it was; an output the JSON rules
refuse -> `failed` / `invalid_output`, saying why; else the AgentResult. A
cancel or a shutdown release keeps the error the agent's ending carried. Error text from the
agent is a fact: it is made storable, never dropped. Also here, as pure functions: the
`finish_runs` item of a terminal decision, and the run as that decision writes it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Final

from agent_runs import validation as check
from agent_runs.display import exception_text
from agent_runs.errors import InvalidArgument, RetryableError
from agent_runs.models import AgentRun, Finish, RunStatus
from agent_runs.worker.lease import Lease
from agent_runs.worker.result import AgentResult

# An object the agent returned instead of a result is described in at most this many characters.
_MAX_DESCRIBED: Final = 500
# What an agent may end a run with by returning it. `cancelled` needs a cancel request first.
_RESULT_STATUSES: Final = frozenset({RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.INTERRUPTED})


@dataclass(frozen=True, slots=True)
class Decision:
    """What the worker will write: a terminal status with its error, or (status None) a
    release for retry."""

    status: RunStatus | None
    error_type: str | None = None
    error_message: str | None = None
    output: Any = None  # the run's result, checked against the JSON rules
    # From a RetryableError: its text, and its retry_after_seconds. Set, the decision is
    # written by retry_or_fail, whose recovery policy has the last word.
    retry_error: str | None = None
    retry_after_seconds: float | None = None

    @property
    def releases(self) -> bool:
        return self.status is None


RELEASE: Final = Decision(None)
CANCELLED: Final = Decision(RunStatus.CANCELLED)
# Results whose error_type/error_message are the agent's own account of what went wrong.
_ERROR_STATUSES: Final = frozenset({RunStatus.FAILED, RunStatus.INTERRUPTED})


@dataclass(frozen=True, slots=True)
class Ending:
    """How the agent call ended: the value it returned, or the exception it raised."""

    returned: object = None
    raised: BaseException | None = None

    @property
    def stops_worker(self) -> bool:
        """The agent asked the whole process to stop (SystemExit, KeyboardInterrupt)."""
        return isinstance(self.raised, SystemExit | KeyboardInterrupt)


def decide(ending: Ending, *, stop_reason: str | None, attempt_no: int, max_tries: int) -> Decision:
    """The decision for an execution whose lease is still ours (see the module docstring)."""
    raised = ending.raised
    if stop_reason == "cancel_requested":
        return _keeping_error(RunStatus.CANCELLED, ending)
    if ending.stops_worker:
        assert raised is not None
        return _failure(RunStatus.INTERRUPTED, "agent_exit", exception_text(raised))
    if stop_reason == "shutdown" and not _completed(ending):
        # The agent was asked to stop: let another worker run it again.
        return _keeping_error(None, ending)
    if isinstance(raised, RetryableError):
        text = exception_text(raised)
        if attempt_no < max_tries:
            decision = _failure(None, "retryable_error", text)
        else:
            decision = _failure(
                RunStatus.FAILED,
                "retries_exhausted",
                f"attempt {attempt_no} of {max_tries} failed with a retryable error: {text}",
            )
        return replace(
            decision,
            retry_error=check.error_message(text),
            retry_after_seconds=_retry_after(raised),
        )
    if raised is not None:
        return _failure(RunStatus.FAILED, "agent_error", exception_text(raised))
    return _from_result(ending.returned)


def _retry_after(raised: RetryableError) -> float | None:
    """The agent's retry_after_seconds when it is a usable delay (else the policy's back-off:
    a bad value from an agent must not lose the failure)."""
    value = getattr(raised, "retry_after_seconds", None)
    try:
        return check.retry_after_seconds(value)
    except InvalidArgument:
        return None


def _keeping_error(status: RunStatus | None, ending: Ending) -> Decision:
    """`status` (None: a release) with whatever error the agent's ending carried: the exception
    it raised, or the error of a failed/interrupted result."""
    raised, result = ending.raised, ending.returned
    if isinstance(raised, RetryableError):
        return _failure(status, "retryable_error", exception_text(raised))
    if raised is not None:
        kind = "agent_exit" if ending.stops_worker else "agent_error"
        return _failure(status, kind, exception_text(raised))
    if isinstance(result, AgentResult) and _status(result) in _ERROR_STATUSES:
        return _failure(status, result.error_type, result.error_message)
    return Decision(status)


def _completed(ending: Ending) -> bool:
    result = ending.returned
    return (
        ending.raised is None
        and isinstance(result, AgentResult)
        and _status(result) == RunStatus.COMPLETED
    )


def _status(result: AgentResult) -> RunStatus | None:
    try:
        return RunStatus(result.status)
    except (ValueError, TypeError):
        return None


def _from_result(result: object) -> Decision:
    if not isinstance(result, AgentResult):
        return _failure(
            RunStatus.FAILED,
            "agent_error",
            f"the agent returned {_describe(result)}, not an AgentResult",
        )
    status = _status(result)
    if status not in _RESULT_STATUSES:
        shown = status.value if status is not None else _describe(result.status)
        why = " without a cancel request" if status == RunStatus.CANCELLED else ""
        return _failure(
            RunStatus.FAILED,
            "agent_error",
            f"the agent returned status {shown}{why}; an agent ends a run completed, failed "
            f"or interrupted (its error: {_describe(result.error_type)}: "
            f"{_describe(result.error_message)})",
        )
    if result.output is not None:
        try:
            check.output_text(result.output)
        except InvalidArgument as exc:
            return _failure(RunStatus.FAILED, "invalid_output", f"the agent's {exc}")
    if status == RunStatus.COMPLETED:
        return Decision(RunStatus.COMPLETED, output=result.output)
    failure = _failure(status, result.error_type, result.error_message)
    return Decision(failure.status, failure.error_type, failure.error_message, result.output)


def _failure(status: RunStatus | None, error_type: object, error_message: object) -> Decision:
    kept_type, kept_message = check.agent_error(error_type, error_message)
    return Decision(status, kept_type, kept_message)


def _describe(value: object) -> str:
    if value is None or isinstance(value, str):
        return repr(value) if value is None else value
    try:
        text = repr(value)
    except BaseException:  # an agent's object may fail to print itself
        text = f"<{type(value).__name__} that cannot be printed>"
    described = f"{type(value).__name__} {text}"
    if len(described) <= _MAX_DESCRIBED:
        return described
    cut = len(described) - _MAX_DESCRIBED
    return f"{described[:_MAX_DESCRIBED]} … [truncated {cut} characters]"


def finish_of(run: AgentRun, lease: Lease, decision: Decision) -> Finish:
    """The finish_runs item of a terminal decision, validated alone: a bad item must not fail
    the other threads' batch."""
    assert decision.status is not None
    finish = Finish(
        run.id,
        lease.worker_id,
        decision.status,
        decision.error_type,
        decision.error_message,
        decision.output,
    )
    check.finishes([finish])
    return finish


def run_as_written(run: AgentRun, decision: Decision, finished_at: datetime | None) -> AgentRun:
    """The run as finish_runs writes `decision`, from what is sent (its lean answer is
    finished_at; None while the write is still to come)."""
    assert decision.status is not None
    return replace(
        run,
        status=decision.status,
        error_type=decision.error_type,
        error_message=check.error_message(decision.error_message),
        output=decision.output,
        worker_id=None,
        heartbeat_at=None,
        lease_expires_at=None,
        finished_at=finished_at,
        updated_at=finished_at or run.updated_at,
    )
