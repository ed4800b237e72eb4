"""AgentRunRepository: every transition of a run and its attempts, one SQL file each.

Each public method is written as its plan (agent_runs.steps): a short validation block, the
sql/ file it runs, and how its answer reads. `@planned` makes it a method that this face drives
on its connection (agent_runs.driver: one round trip per transition); the asyncio face,
agent_runs.aio.AsyncAgentRunRepository, drives the very same plans. This module holds one
run's creation, reads and transitions; the rest is mixed in from its siblings: the worker's
transitions (worker_transitions), create_runs (run_batches), the operator's queries
(operator_queries), the recovery policy (recovery_transitions) and limits per key (key_limits).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from psycopg import errors as pg_errors
from psycopg.types.json import Jsonb

from agent_runs import validation as check
from agent_runs.driver import SyncDriver
from agent_runs.errors import (
    UQ_ONE_ACTIVE_PER_THREAD,
    InvalidArgument,
    NotLeaseOwner,
    ThreadBusy,
)
from agent_runs.ids import new_run_id
from agent_runs.models import AgentRun, Claim, RunAttempt, RunStatus, Transition
from agent_runs.repository.claim_plans import (
    LEASE_EXPIRED_MESSAGE,
    claim,
    first_claimed,
    next_claim,
)
from agent_runs.repository.key_limits import KeyLimits
from agent_runs.repository.operator_queries import OperatorQueries
from agent_runs.repository.recovery_transitions import RecoveryTransitions
from agent_runs.repository.run_batches import RunBatches
from agent_runs.repository.worker_transitions import WorkerTransitions
from agent_runs.rows import attempt_of, run_of
from agent_runs.steps import Execute, Plan, Transaction, planned
from agent_runs.transport import Row, Statement, statement

__all__ = ["LEASE_EXPIRED_MESSAGE", "AgentRunRepository", "new_run_id"]


class AgentRunRepository(
    RecoveryTransitions, OperatorQueries, WorkerTransitions, RunBatches, KeyLimits, SyncDriver
):
    """The data access object for agent_runs and agent_run_attempts over one psycopg connection.

    Every method runs in its own explicit transaction, which becomes a savepoint inside a
    transaction the caller already has open. Each transition locks the run row first and
    changes the run and its attempt in that one transaction (one statement, one round trip:
    see agent_runs.transport). Threads sharing the connection take turns, call by call.
    """

    # -- creating and reading -----------------------------------------------------------

    @planned
    def create_run(
        self,
        *,
        thread_id: str,
        agent_slug: str,
        uid: str,
        request_id: str,
        input_payload: Mapping[str, Any] | None = None,
        run_type: str = "chat",
        created_by_run_id: str | None = None,
        run_id: str | None = None,
        priority: int = 0,
        available_at: datetime | None = None,
        concurrency_key: str | None = None,
    ) -> Plan[AgentRun]:
        """Create a pending run; the same request_id again returns the existing run.

        Claims take the lowest priority (0-9) first; the run is claimable from available_at
        (None: now). Raises ThreadBusy when another non-terminal run exists on
        (uid, agent_slug, thread_id). concurrency_key: the key whose limit (set_limit) this
        run counts against, if any.
        """
        params = {
            "thread_id": check.identifier("thread_id", thread_id),
            "agent_slug": check.identifier("agent_slug", agent_slug),
            "uid": check.identifier("uid", uid),
            "request_id": check.identifier("request_id", request_id),
            "input_payload": Jsonb(
                check.json_object("input_payload", {} if input_payload is None else input_payload)
            ),
            "run_type": check.run_type(run_type),
            "created_by_run_id": check.optional_identifier("created_by_run_id", created_by_run_id),
            "run_id": new_run_id() if run_id is None else check.identifier("run_id", run_id),
            "trace_context": None,
            "priority": check.priority(priority),
            "available_at": check.available_at(available_at),
            "concurrency_key": check.optional_concurrency_key(concurrency_key),
        }
        if params["created_by_run_id"] is not None and params["created_by_run_id"] == run_id:
            raise InvalidArgument(
                f"created_by_run_id {created_by_run_id!r} is the run's own run_id: a run cannot "
                "be its own parent"
            )
        telemetry = self.telemetry
        if telemetry is None:
            run, _ = yield from _create(statement("create_run"), params)
            return run
        with telemetry.sending(str(params["agent_slug"]), str(params["run_id"])) as sending:
            carried = sending.trace_context
            params["trace_context"] = None if carried is None else Jsonb(carried)
            run, created = yield from _create(statement("create_run"), params)
            sending.sent(run, created=created)
            return run

    @planned
    def get_run(self, run_id: str) -> Plan[AgentRun | None]:
        rows: list[Row] = yield Execute(
            statement("get_run"), {"run_id": check.identifier("run_id", run_id)}
        )
        return run_of(rows[0]) if rows else None

    @planned
    def list_run_attempts(self, run_id: str) -> Plan[list[RunAttempt]]:
        params = {"run_id": check.identifier("run_id", run_id)}
        rows: list[Row] = yield Execute(statement("list_run_attempts"), params)
        return [attempt_of(row) for row in rows]

    @planned
    def get_open_attempt(self, run_id: str) -> Plan[RunAttempt | None]:
        params = {"run_id": check.identifier("run_id", run_id)}
        rows: list[Row] = yield Execute(statement("get_open_attempt"), params)
        return attempt_of(rows[0]) if rows else None

    # -- ownership -----------------------------------------------------------------------

    @planned
    def mark_running(
        self,
        run_id: str,
        *,
        worker_id: str,
        lease_seconds: float,
        now: datetime | None = None,
    ) -> Plan[Claim]:
        """Claim a run (initial claim) or refresh the lease of its same live owner."""
        rows = yield from claim(
            "mark_running",
            {
                "run_id": check.identifier("run_id", run_id),
                "worker_id": check.worker_id(worker_id),
                **check.lease(lease_seconds, now),
                "lost_message": LEASE_EXPIRED_MESSAGE,
            },
        )
        if not rows:
            return Claim(None, False)
        row = rows[0]
        run = run_of(row)
        acquired = bool(row["acquired"])
        if self.telemetry is not None and acquired and row["initial_claim"]:
            self.telemetry.claimed([(run, None)], {})  # attempt_no: not in this answer
        return Claim(run, acquired)

    @planned
    def claim_next(
        self,
        *,
        worker_id: str,
        lease_seconds: float,
        now: datetime | None = None,
        agent_slugs: list[str] | None = None,
    ) -> Plan[AgentRun | None]:
        """Claim the first available run (lowest priority, then earliest available_at, then id:
        FIFO among runs nobody delayed or prioritised), or None when there is none."""
        rows = yield from claim(
            "claim_next", next_claim(worker_id, lease_seconds, now, agent_slugs)
        )
        found = yield from first_claimed(self.telemetry, rows)
        return None if found is None else found.run

    @planned
    def renew_lease(
        self,
        run_id: str,
        *,
        worker_id: str,
        lease_seconds: float,
        now: datetime | None = None,
    ) -> Plan[bool]:
        """Extend the live lease of its owner (run and open attempt); False when not the owner."""
        rows: list[Row] = yield Execute(
            statement("renew_lease"),
            {
                "run_id": check.identifier("run_id", run_id),
                "worker_id": check.worker_id(worker_id),
                **check.lease(lease_seconds, now),
            },
        )
        if self.telemetry is not None and rows:
            self.telemetry.renewed(1)
        return bool(rows)

    @planned
    def release_lease_for_retry(
        self,
        run_id: str,
        *,
        worker_id: str,
        error_type: str | None = None,
        error_message: str | None = None,
        now: datetime | None = None,
        retry_after_seconds: float | None = None,
    ) -> Plan[bool]:
        """Give a running run back to the queue (pending); the attempt ends retry_released,
        with the error that made it retry when one is given (the run keeps none). The run
        keeps its place, or with retry_after_seconds is claimable from now + that delay (the
        attempt's retry_at)."""
        at = check.now(now)
        rows: list[Row] = yield Execute(
            statement("release_lease_for_retry"),
            {
                "run_id": check.identifier("run_id", run_id),
                "worker_id": check.worker_id(worker_id),
                "error_type": check.error_type(error_type),
                "error_message": check.error_message(error_message),
                "now": at,
                "retry_after_seconds": check.retry_after_seconds(retry_after_seconds, at),
            },
        )
        if self.telemetry is not None and rows:
            self.telemetry.ended(worker_id, "retry_released", error_type)
        return bool(rows)

    # -- finishing -----------------------------------------------------------------------

    @planned
    def set_terminal_status(
        self,
        run_id: str,
        *,
        status: RunStatus | str,
        worker_id: str | None = None,
        error_type: str | None = None,
        error_message: str | None = None,
        now: datetime | None = None,
        output: Any = None,
    ) -> Plan[Transition]:
        """Finish a run (and its owner's attempt) when the transition rules allow it; `output`
        (any JSON value, at most 1 MiB of JSON text) is the run's result."""
        rows: list[Row] = yield Execute(
            statement("set_terminal_status"),
            {
                "run_id": check.identifier("run_id", run_id),
                "status": check.terminal_status(status).value,
                "worker_id": check.optional_worker_id(worker_id),
                "error_type": check.error_type(error_type),
                "error_message": check.error_message(error_message),
                "output": check.output_text(output),
                "now": check.now(now),
            },
        )
        if not rows:
            return Transition(None, False)
        transition = Transition(run_of(rows[0]), bool(rows[0]["changed"]))
        if self.telemetry is not None and transition.changed and worker_id is not None:
            self.telemetry.ended(worker_id, str(status), error_type)
        return transition

    @planned
    def request_cancel(self, run_id: str, *, now: datetime | None = None) -> Plan[AgentRun | None]:
        """Cancel a run that never started; ask the owner of any other live run to cancel."""
        rows: list[Row] = yield Execute(
            statement("request_cancel"),
            {"run_id": check.identifier("run_id", run_id), "now": check.now(now)},
        )
        return run_of(rows[0]) if rows else None

    @planned
    def reconcile_expired_leases(
        self, *, now: datetime | None = None, limit: int = 500
    ) -> Plan[list[AgentRun]]:
        """Converge every run that lost its owner (at most `limit`): failed, or pending again
        when its recovery policy allows another attempt; returns them as converged."""
        params = {
            "now": check.now(now),
            "limit": check.limit(limit),
            "lost_message": LEASE_EXPIRED_MESSAGE,
        }

        telemetry = self.telemetry
        started_ns = 0 if telemetry is None else telemetry.clock_ns()

        def converge() -> Plan[tuple[list[AgentRun], list[Row]]]:
            """Lock the runs that lost their owner (SKIP LOCKED), then converge exactly those;
            with telemetry, read the attempts this pass closed (for their durations)."""
            locked: list[Row] = yield Execute(statement("reconcile_expired_leases.lock"), params)
            if not locked:
                return [], []
            run_ids = [row["id"] for row in locked]
            rows: list[Row] = yield Execute(
                statement("reconcile_expired_leases"), {**params, "run_ids": run_ids}
            )
            runs = [run_of(row) for row in rows]
            if telemetry is None or not runs:
                return runs, []
            closed: list[Row] = yield Execute(
                statement("reconcile_expired_leases.attempts"),
                {
                    "run_ids": [r.id for r in runs],
                    "finished_ats": [r.finished_at or r.updated_at for r in runs],
                },
            )
            return runs, closed

        converged: list[AgentRun]
        closed: list[Row]
        converged, closed = yield Transaction(converge())
        if telemetry is not None and converged:
            attempts = [(r.values[0], r.values[1], r.values[2], r.values[3]) for r in closed]
            telemetry.reconciled(converged, attempts, started_ns)
            for run in converged:
                telemetry.instruments.decided(
                    run.agent_slug, run.status, run.error_type, "lost_lease"
                )
        return converged

    @planned
    def record_run_manifest(
        self,
        run_id: str,
        *,
        manifest: Mapping[str, Any],
        fingerprint: str,
        worker_id: str,
        now: datetime | None = None,
    ) -> Plan[Transition]:
        """Record the run manifest once, by the live owner of the running run."""
        rows: list[Row] = yield Execute(
            statement("record_run_manifest"),
            {
                "run_id": check.identifier("run_id", run_id),
                "manifest": Jsonb(check.json_object("manifest", manifest)),
                "fingerprint": check.fingerprint(fingerprint),
                "worker_id": check.worker_id(worker_id),
                "now": check.now(now),
            },
        )
        if not rows:
            return Transition(None, False)
        row = rows[0]
        if not row["is_owner"]:
            raise NotLeaseOwner(
                f"{worker_id!r} is not the lease owner of running run {run_id!r} "
                "(only the owner of a running run with a live lease may record its manifest)"
            )
        return Transition(run_of(row), bool(row["changed"]))

    @planned
    def record_resumed_from(
        self,
        run_id: str,
        *,
        worker_id: str,
        checkpoint_id: str,
        step: int,
        now: datetime | None = None,
    ) -> Plan[bool]:
        """Record, once, the checkpoint (and its step) from which the live owner's open attempt
        resumed an earlier attempt's execution; False when refused or already recorded."""
        rows: list[Row] = yield Execute(
            statement("record_resumed_from"),
            {
                "run_id": check.identifier("run_id", run_id),
                "worker_id": check.worker_id(worker_id),
                "checkpoint_id": check.checkpoint_id(checkpoint_id),
                "step": check.integer("step", step, -1, 2**31 - 1),
                "now": check.now(now),
            },
        )
        return bool(rows)


def _create(stmt: Statement, params: dict[str, Any]) -> Plan[tuple[AgentRun, bool]]:
    """create_run's statements (`stmt`, then create_run.existing): (the run, whether this call
    created it)."""
    try:
        rows: list[Row] = yield Execute(stmt, params)
        if rows:
            return run_of(rows[0]), True
        # request_id seen before: a new statement sees its run
        rows = yield Execute(statement("create_run.existing"), params)
        if not rows:  # pragma: no cover - the other run was deleted in between
            raise InvalidArgument(f"request_id {params['request_id']!r} is being reused; retry")
        return run_of(rows[0]), False
    except pg_errors.UniqueViolation as exc:
        # A concurrent create with the same request_id can trip the thread index before
        # ON CONFLICT sees the request_id: idempotency is checked first, so look again.
        existing: list[Row] = yield Execute(statement("create_run.existing"), params)
        if existing:
            return run_of(existing[0]), False
        if exc.diag.constraint_name == UQ_ONE_ACTIVE_PER_THREAD:
            raise ThreadBusy(
                f"thread {params['thread_id']!r} of uid {params['uid']!r} already has an active "
                f"run of agent {params['agent_slug']!r}"
            ) from None
        if exc.diag.constraint_name == "agent_runs_pkey":
            raise InvalidArgument(f"run_id {params['run_id']!r} already exists") from None
        raise
    except pg_errors.ForeignKeyViolation:
        raise InvalidArgument(
            f"created_by_run_id {params['created_by_run_id']!r} is not an existing run"
        ) from None
