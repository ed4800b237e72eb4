"""The recovery policy's transitions and its settings: retry_or_fail, requeue_run,
list_run_requeues and set/get/list/delete_policy. Plans (agent_runs.steps), mixed into both
repository faces.

Every decision is taken inside the run row lock by the statement that closes the attempt (one
round trip), from the agent's policy, the run's attempts and requeues, and `now`; it is recorded
on the closed attempt (`retry_at`), so the explanation can name it (agent_runs.explain).
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Final

from psycopg import errors as pg_errors

from agent_runs import validation as check
from agent_runs.errors import UQ_ONE_ACTIVE_PER_THREAD, InvalidArgument, ThreadBusy
from agent_runs.models import AgentRun, RunStatus, Transition
from agent_runs.policies import BUILT_IN_SOURCE, RunPolicy, RunRequeue
from agent_runs.rows import run_of, utc
from agent_runs.steps import Execute, Plan, Transaction, planned
from agent_runs.transport import Row, statement

if TYPE_CHECKING:  # never imported at run time: telemetry off costs no import
    from agent_runs.telemetry import Telemetry


class _Keep:
    """The default of set_policy's fields: keep the value the slug has (or inherits)."""

    def __repr__(self) -> str:
        return "KEEP"


KEEP: Final[Any] = _Keep()
# The worker's retryable errors carry this type; their text is kept as it was written.
_RETRYABLE_ERROR: Final = "retryable_error"


class RecoveryTransitions:
    """retry_or_fail, requeue_run, list_run_requeues, list_scheduled_runs and the policy
    settings."""

    if TYPE_CHECKING:
        telemetry: Telemetry | None

    @planned
    def retry_or_fail(
        self,
        run_id: str,
        *,
        worker_id: str,
        error_type: str,
        error_message: str | None = None,
        retry_after_seconds: float | None = None,
        now: datetime | None = None,
        max_attempts: int | None = None,
    ) -> Plan[Transition]:
        """The live owner reports a transient failure of its attempt n (in budget). While
        n < max_attempts and the deadline has not passed, the run goes back to pending,
        claimable from now + delay (the attempt closes retry_released with the error and
        retry_at); else the run ends failed / retries_exhausted (or deadline_exceeded), its
        message keeping the error. `max_attempts` caps the policy's (a worker's max_tries).
        Refused (not the owner, lease not live, not running) -> (run, False), nothing written.
        """
        at = check.now(now)
        kept_type = check.error_type(error_type)
        if kept_type is None:
            raise InvalidArgument("error_type is required: it says why the attempt failed")
        message = check.error_message(error_message)
        shown = message or "(no message)"
        if kept_type != _RETRYABLE_ERROR:
            shown = f"{kept_type}: {shown}"
        params = {
            "run_id": check.identifier("run_id", run_id),
            "worker_id": check.worker_id(worker_id),
            "error_type": kept_type,
            "error_message": message,
            "shown_error": check.error_message(shown),
            "retry_after_seconds": check.retry_after_seconds(retry_after_seconds, at),
            "max_attempts": None if max_attempts is None else check.max_attempts(max_attempts),
            "now": at,
        }
        rows: list[Row] = yield Execute(statement("retry_or_fail"), params)
        if not rows:
            return Transition(None, False)
        transition = Transition(run_of(rows[0]), bool(rows[0]["changed"]))
        if self.telemetry is not None and transition.changed and transition.run is not None:
            run = transition.run
            if run.status == RunStatus.PENDING:
                self.telemetry.ended(worker_id, "retry_released", kept_type)
            else:
                self.telemetry.ended(worker_id, "failed", run.error_type)
            self.telemetry.instruments.decided(
                run.agent_slug, run.status, run.error_type, "failure"
            )
        return transition

    @planned
    def requeue_run(
        self, run_id: str, *, reason: str | None = None, now: datetime | None = None
    ) -> Plan[Transition]:
        """Send a failed, cancelled or interrupted run back to the queue (pending, available
        now) with a fresh budget; an agent_run_requeues row records it. A completed run is
        refused (InvalidArgument: create a new run to run it again); a run not ended ->
        (run, False); another active run on its thread -> ThreadBusy; unknown ->
        InvalidArgument."""
        params = {
            "run_id": check.identifier("run_id", run_id),
            "reason": check.reason(reason),
            "now": check.now(now),
        }
        try:
            rows: list[Row] = yield Execute(statement("requeue_run"), params)
        except pg_errors.UniqueViolation as exc:
            if exc.diag.constraint_name != UQ_ONE_ACTIVE_PER_THREAD:
                raise
            raise ThreadBusy(
                f"run {run_id!r} cannot be requeued: its thread already has an active run of "
                "the same agent and user (cancel or finish that one first)"
            ) from None
        if not rows:
            raise InvalidArgument(f"run_id {run_id!r} is not an existing run")
        run = run_of(rows[0])
        if run.status == RunStatus.COMPLETED:
            raise InvalidArgument(
                f"run {run_id!r} completed: a completed run is never requeued; create a new run "
                "(a new request_id) to run it again"
            )
        return Transition(run, bool(rows[0]["changed"]))

    @planned
    def list_run_requeues(self, run_id: str) -> Plan[list[RunRequeue]]:
        """A run's requeues, oldest first."""
        params = {"run_id": check.identifier("run_id", run_id)}
        rows: list[Row] = yield Execute(statement("list_run_requeues"), params)
        return [
            RunRequeue(
                id=int(row["id"]),
                run_id=row["run_id"],
                requeued_at=utc(row["requeued_at"]),
                previous_status=row["previous_status"],
                previous_error_type=row["previous_error_type"],
                reason=row["reason"],
            )
            for row in rows
        ]

    @planned
    def list_scheduled_runs(
        self, *, agent_slug: str | None = None, limit: int = 50, now: datetime | None = None
    ) -> Plan[list[AgentRun]]:
        """Pending runs not yet available (available_at > now), the soonest first."""
        params = {
            "agent_slug": check.optional_identifier("agent_slug", agent_slug),
            "limit": check.limit(limit),
            "now": check.now(now),
        }
        rows: list[Row] = yield Execute(statement("list_scheduled_runs"), params)
        return [run_of(row) for row in rows]

    @planned
    def next_available_in(
        self, *, agent_slugs: list[str] | None = None, now: datetime | None = None
    ) -> Plan[float | None]:
        """Seconds until the next run scheduled for later becomes claimable (by the database's
        clock, or `now`); None when none is scheduled. An idle worker sleeps no longer."""
        params = {"agent_slugs": check.agent_slugs(agent_slugs), "now": check.now(now)}
        rows: list[Row] = yield Execute(statement("next_available"), params)
        seconds = rows[0]["seconds"] if rows else None
        return None if seconds is None else max(0.0, float(seconds))

    # -- policies ------------------------------------------------------------------------

    @planned
    def get_policy(self, agent_slug: str) -> Plan[RunPolicy]:
        """The effective policy of `agent_slug`: its row, else the '*' row, else built-in."""
        slug = check.policy_slug(agent_slug)
        rows: list[Row] = yield Execute(statement("get_policy"), {"agent_slug": slug})
        return _policy(slug, rows[0])

    @planned
    def list_policies(self) -> Plan[list[RunPolicy]]:
        """Every configured policy row ('*' first, then by slug)."""
        rows: list[Row] = yield Execute(statement("list_policies"), {})
        return [_policy(row["agent_slug"], row) for row in rows]

    @planned
    def delete_policy(self, agent_slug: str) -> Plan[bool]:
        """Remove a slug's row (its runs then follow '*' or the built-in policy); False when
        it had none."""
        slug = check.policy_slug(agent_slug)
        rows: list[Row] = yield Execute(statement("delete_policy"), {"agent_slug": slug})
        return bool(rows)

    @planned
    def set_policy(
        self,
        agent_slug: str,
        *,
        max_attempts: int = KEEP,
        max_lost_leases: int = KEEP,
        backoff_seconds: float = KEEP,
        backoff_max_seconds: float = KEEP,
        backoff_jitter: float = KEEP,
        deadline_seconds: float | None = KEEP,
    ) -> Plan[RunPolicy]:
        """Set a slug's policy ('*': the default for slugs without a row). Omitted fields keep
        their value; a slug's first row starts from its effective policy. deadline_seconds=None
        clears the deadline. Applies to the next decision of every run of that slug."""
        slug = check.policy_slug(agent_slug)
        given: dict[str, Any] = {}
        if max_attempts is not KEEP:
            given["max_attempts"] = check.max_attempts(max_attempts)
        if max_lost_leases is not KEEP:
            given["max_lost_leases"] = check.max_lost_leases(max_lost_leases)
        if backoff_seconds is not KEEP:
            given["backoff_seconds"] = check.backoff_seconds(backoff_seconds)
        if backoff_max_seconds is not KEEP:
            given["backoff_max_seconds"] = check.backoff_seconds(
                backoff_max_seconds, "backoff_max_seconds"
            )
        if backoff_jitter is not KEEP:
            given["backoff_jitter"] = check.backoff_jitter(backoff_jitter)
        if deadline_seconds is not KEEP:
            given["deadline_seconds"] = check.deadline_seconds(deadline_seconds)
        both = {"backoff_seconds", "backoff_max_seconds"}
        if both <= set(given) and given["backoff_max_seconds"] < given["backoff_seconds"]:
            raise _backoff_refused(given["backoff_max_seconds"], given["backoff_seconds"])

        def write() -> Plan[RunPolicy]:
            rows: list[Row] = yield Execute(statement("get_policy"), {"agent_slug": slug})
            current = _policy(slug, rows[0])
            merged = {name: given.get(name, getattr(current, name)) for name in _FIELDS}
            if merged["backoff_max_seconds"] < merged["backoff_seconds"]:
                raise _backoff_refused(merged["backoff_max_seconds"], merged["backoff_seconds"])
            written: list[Row] = yield Execute(
                statement("set_policy"), {"agent_slug": slug, **merged}
            )
            return _policy(slug, written[0])

        policy: RunPolicy = yield Transaction(write())
        return policy


_FIELDS: Final = (
    "max_attempts",
    "max_lost_leases",
    "backoff_seconds",
    "backoff_max_seconds",
    "backoff_jitter",
    "deadline_seconds",
)


def _backoff_refused(maximum: float, backoff: float) -> InvalidArgument:
    return InvalidArgument(
        f"backoff_max_seconds must be >= backoff_seconds, got {maximum:g} < {backoff:g}"
    )


def _policy(slug: str, row: Row) -> RunPolicy:
    """get_policy's (or a policy row's) answer as the RunPolicy of `slug`."""
    if row["source"] is None:
        return RunPolicy(slug)
    deadline = row["deadline_seconds"]
    return RunPolicy(
        agent_slug=slug,
        max_attempts=int(row["max_attempts"]),
        max_lost_leases=int(row["max_lost_leases"]),
        backoff_seconds=float(row["backoff_seconds"]),
        backoff_max_seconds=float(row["backoff_max_seconds"]),
        backoff_jitter=float(row["backoff_jitter"]),
        deadline_seconds=None if deadline is None else float(deadline),
        source=row["source"] or BUILT_IN_SOURCE,
        updated_at=utc(row["updated_at"]),
    )
