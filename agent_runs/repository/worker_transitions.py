"""The worker's transitions: answers it needs without a second read, and batches (one
statement for many runs, each under its own lock and rule). Plans (agent_runs.steps), mixed into
both repository faces."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING

from agent_runs import validation as check
from agent_runs.models import AgentRun, ClaimedRun, Finish, RunStatus
from agent_runs.repository.claim_plans import (
    LEASE_EXPIRED_MESSAGE,
    claim,
    claimed,
    first_claimed,
    next_claim,
)
from agent_runs.rows import run_of, utc
from agent_runs.steps import Execute, Plan, planned
from agent_runs.transport import Row, statement

if TYPE_CHECKING:  # never imported at run time: telemetry off costs no import
    from agent_runs.telemetry import Telemetry


class WorkerTransitions:
    """get_run_by_owner, claim_next_attempt(s), renew_leases, finish_runs and
    finish_runs_and_claim."""

    if TYPE_CHECKING:
        telemetry: Telemetry | None

    @planned
    def get_run_by_owner(self, worker_id: str) -> Plan[AgentRun | None]:
        """The live run whose lease this owner token holds, if any (e.g. after a lost reply)."""
        params = {"worker_id": check.worker_id(worker_id)}
        rows: list[Row] = yield Execute(statement("get_run_by_owner"), params)
        if not rows:
            return None
        run = run_of(rows[0])
        if self.telemetry is not None:  # a claim whose reply was lost: its span starts now
            self.telemetry.claimed([(run, None)], {})
        return run

    @planned
    def claim_next_attempt(
        self,
        *,
        worker_id: str,
        lease_seconds: float,
        now: datetime | None = None,
        agent_slugs: list[str] | None = None,
    ) -> Plan[ClaimedRun | None]:
        """claim_next that also answers the attempt_no it opened (no second read needed)."""
        rows = yield from claim(
            "claim_next", next_claim(worker_id, lease_seconds, now, agent_slugs)
        )
        return (yield from first_claimed(self.telemetry, rows))

    @planned
    def claim_next_attempts(
        self,
        *,
        worker_ids: Sequence[str],
        lease_seconds: float,
        now: datetime | None = None,
        agent_slugs: list[str] | None = None,
    ) -> Plan[list[ClaimedRun]]:
        """claim_next for up to one run per owner token, in one statement: the n-th
        claimable run goes to worker_ids[n], each with claim_next's rules and attempt facts;
        fewer (or none) when fewer are claimable. In claim order."""
        rows = yield from claim(
            "claim_next_attempts",
            {
                "worker_ids": check.worker_ids(worker_ids),
                **check.lease(lease_seconds, now),
                "agent_slugs": check.agent_slugs(agent_slugs),
                "lost_message": LEASE_EXPIRED_MESSAGE,
            },
        )
        found = _claimed_in_claim_order(rows)
        if self.telemetry is not None and found:
            yield from claimed(self.telemetry, found)
        return found

    @planned
    def renew_leases(
        self,
        leases: Mapping[str, str],
        *,
        lease_seconds: float,
        now: datetime | None = None,
    ) -> Plan[dict[str, RunStatus]]:
        """renew_lease for many run_id -> worker_id leases in one statement.

        Returns the renewed runs with their current status (a cancel request shows as
        cancel_requested); refused leases are absent.
        """
        run_ids, worker_ids = check.leases(leases)
        params = {
            "run_ids": run_ids,
            "worker_ids": worker_ids,
            **check.lease(lease_seconds, now),
        }
        if not run_ids:
            return {}
        rows: list[Row] = yield Execute(statement("renew_leases"), params)
        if self.telemetry is not None and rows:
            self.telemetry.renewed(len(rows))
        return {row["id"]: RunStatus(row["status"]) for row in rows}

    @planned
    def finish_runs(
        self, finishes: Sequence[Finish], *, now: datetime | None = None
    ) -> Plan[dict[str, datetime]]:
        """set_terminal_status for many runs of their owners, in one statement (each run under
        its own lock and rule). It answers only run_id -> finished_at of each run finished; a
        refused or missing run is absent (ask set_terminal_status or get_run why)."""
        run_ids, worker_ids, statuses, error_types, error_messages, outputs = check.finishes(
            finishes
        )
        rows: list[Row] = yield Execute(
            statement("finish_runs"),
            {
                "run_ids": run_ids,
                "worker_ids": worker_ids,
                "statuses": statuses,
                "error_types": error_types,
                "error_messages": error_messages,
                "outputs": outputs,
                "now": check.now(now),
            },
        )
        finished = {row["id"]: utc(row["finished_at"]) for row in rows}
        if self.telemetry is not None:
            _ended(self.telemetry, finishes, finished)
        return finished

    @planned
    def finish_runs_and_claim(
        self,
        finishes: Sequence[Finish],
        *,
        worker_ids: Sequence[str],
        lease_seconds: float,
        now: datetime | None = None,
        agent_slugs: list[str] | None = None,
    ) -> Plan[tuple[dict[str, datetime], list[ClaimedRun]]]:
        """finish_runs, then claim_next_attempts for up to one run per worker_id, less one per
        refused end (its slot waits until its end is written alone), in one statement and one
        commit: a worker's slot goes from its run's end to its next run without a commit in
        between, and slots already free fill in the same statement. (finish_runs' answer, the
        runs claimed in claim order)."""
        run_ids, owners, statuses, error_types, error_messages, outputs = check.finishes(finishes)
        rows = yield from claim(
            "finish_runs_and_claim",
            {
                "run_ids": run_ids,
                "finish_worker_ids": owners,
                "statuses": statuses,
                "error_types": error_types,
                "error_messages": error_messages,
                "outputs": outputs,
                "worker_ids": check.worker_ids(worker_ids),
                **check.lease(lease_seconds, now),
                "agent_slugs": check.agent_slugs(agent_slugs),
                "lost_message": LEASE_EXPIRED_MESSAGE,
            },
        )
        ends = rows[0]  # every row carries the batch's ends; there is always one
        finished = {
            run_id: utc(at)
            for run_id, at in zip(ends["finished_ids"], ends["finished_ats"], strict=True)
        }
        found = _claimed_in_claim_order([row for row in rows if row["id"]])
        if self.telemetry is not None:
            _ended(self.telemetry, finishes, finished)
            if found:
                yield from claimed(self.telemetry, found)
        return finished, found


def _claimed_in_claim_order(rows: list[Row]) -> list[ClaimedRun]:
    """The claimed runs of a claim statement's rows in claim order (priority, available_at,
    id): oldest first among runs nobody delayed or prioritised."""
    found = [ClaimedRun(run_of(row), int(row["attempt_no"])) for row in rows]
    found.sort(key=lambda c: (c.run.priority, c.run.available_at or c.run.created_at, c.run.id))
    return found


def _ended(
    telemetry: Telemetry, finishes: Sequence[Finish], finished: Mapping[str, datetime]
) -> None:
    """The attempts' end metrics of the runs a batch finished (a refused end records nothing)."""
    for finish in finishes:
        if finish.run_id in finished:
            telemetry.ended(finish.worker_id, str(finish.status), finish.error_type)
