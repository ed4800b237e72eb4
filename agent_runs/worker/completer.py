"""The completer: write an execution's decision while the lease can be proven.

A terminal status is first written together with other threads' in one `finish_runs`
(group commit); what that does not write goes on one run at a time, as follows.
Database failures are retried with back-off while the lease holds. A failed call may have
committed although its reply was lost, so after one the completer first reads whether its own
attempt already ended as decided. A refusal is final (the lease is no longer ours), except when
a cancel request arrived after the last heartbeat: then the run is finished `cancelled`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import datetime

from psycopg_pool import PoolClosed

from agent_runs import validation as check
from agent_runs.backoff import Backoff
from agent_runs.display import one_line
from agent_runs.errors import DB_ERRORS
from agent_runs.logs import logger
from agent_runs.models import AgentRun, AttemptOutcome, Finish, RunStatus
from agent_runs.worker.batching import GroupCommit
from agent_runs.worker.checkout import Repositories
from agent_runs.worker.heartbeat import HeartbeatService
from agent_runs.worker.lease import Claimed, Lease
from agent_runs.worker.outcome import CANCELLED, RELEASE, Decision, finish_of, run_as_written

log = logger("agent_runs.worker")


class Completer:
    """Writes decisions for one worker (see the module docstring)."""

    def __init__(
        self,
        repository: Repositories,
        *,
        lease_seconds: float,
        retry_cap: float,
        max_tries: int | None = None,
    ) -> None:
        self._repository = repository
        self._lease_seconds = lease_seconds
        self._retry_cap = retry_cap
        self._max_tries = max_tries
        # Threads that finish runs at the same time share one finish_runs statement.
        self.finishing = GroupCommit(self.finish_batch, max_batch=check.MAX_BATCH)

    def finish(
        self,
        run: AgentRun,
        lease: Lease,
        decision: Decision,
        tag: str,
        *,
        batched: bool = True,
        in_doubt: bool = False,
    ) -> AgentRun:
        """Write `decision` for `run`; the run as it is afterwards (as far as known).

        A terminal status is first written in a batch with other threads' (finish_runs); a
        refusal or a failure there goes on one run at a time, where the refusal is explained.
        `batched=False` starts there; `in_doubt` says an earlier try may have committed.
        """
        lease.finishing = True
        backoff = Backoff(cap=self._retry_cap)
        # Once the agent stopped the heartbeat the lease cannot be proven; try for one lease.
        give_up_at = time.monotonic() + self._lease_seconds
        batched = batched and decision.status is not None and decision.retry_error is None
        if batched and self._unwritable(lease, give_up_at) is None:
            done, in_doubt = self._in_batch(run, lease, decision, tag)
            if done is not None:
                return done
            if in_doubt:
                time.sleep(backoff.next_delay())
        while True:
            if in_doubt and (done := self._confirm(run.id, lease, decision)) is not None:
                log.info("%s: %s (confirmed after a lost reply)", tag, done.status)
                return done
            unwritable = self._unwritable(lease, give_up_at)
            if unwritable is not None:
                log.warning("%s: %s; writing nothing", tag, unwritable)
                return self.reread(run) if lease.lost or not lease.heartbeat_stopped else run
            try:
                written, current = self._write(run, lease, decision)
            except PoolClosed:
                log.warning("%s: pool closed before the result was written", tag)
                return run
            except DB_ERRORS as exc:
                in_doubt = True
                delay = backoff.next_delay()
                what = decision.status or "retry release"
                log.warning(
                    "%s: could not write %s (%s); retrying in %.1fs",
                    tag,
                    what,
                    one_line(exc, with_type=True),
                    delay,
                )
                time.sleep(delay)
                continue
            if written is not None:
                log.info("%s: %s%s", tag, decision.status or "released for retry", _error(decision))
                return written
            # Refused: the database answered. Perhaps to our own earlier write.
            if in_doubt and (done := self._confirm(run.id, lease, decision)) is not None:
                log.info("%s: %s (confirmed after a lost reply)", tag, done.status)
                return done
            in_doubt = False
            if _cancel_arrived(current, lease, decision):
                decision = CANCELLED
                continue
            lease.lost = True
            log.warning(
                "%s: the repository refused %s (lease no longer ours; run is %s)",
                tag,
                decision.status or "the retry release",
                current.status if current is not None else "gone",
            )
            return current or run

    def _in_batch(
        self, run: AgentRun, lease: Lease, decision: Decision, tag: str
    ) -> tuple[AgentRun | None, bool]:
        """The first try, in one finish_runs with other threads' ends: (the run as written,
        False), or (None, whether the failed batch may have committed)."""
        finish = finish_of(run, lease, decision)
        try:
            finished_at = self.finishing.submit(finish)
        except PoolClosed:
            log.warning("%s: pool closed before the result was written", tag)
            return run, False
        except DB_ERRORS as exc:
            log.warning(
                "%s: could not write %s (%s); retrying",
                tag,
                decision.status,
                one_line(exc, with_type=True),
            )
            return None, True
        if finished_at is None:
            return None, False  # refused: the one-run path finds out why
        log.info("%s: %s%s", tag, decision.status, _error(decision))
        return run_as_written(run, decision, finished_at), False

    def finish_batch(self, finishes: list[Finish]) -> list[datetime | None]:
        """finish_runs for `finishes`: each one's finished_at, or None where refused."""
        with self._repository() as repo:
            finished = repo.finish_runs(finishes)
        return [finished.get(finish.run_id) for finish in finishes]

    def _unwritable(self, lease: Lease, give_up_at: float) -> str | None:
        if lease.lost:
            return "lease lost"
        if lease.heartbeat_stopped:
            return (
                "database unreachable; result dropped" if time.monotonic() >= give_up_at else None
            )
        if lease.expired():
            return "lease could not be proven until its expiry"
        return None

    def _write(
        self, run: AgentRun, lease: Lease, decision: Decision
    ) -> tuple[AgentRun | None, AgentRun | None]:
        """(the run as written, None) or, when refused, (None, the run as it is now)."""
        with self._repository() as repo:
            if decision.retry_error is not None:
                retried = repo.retry_or_fail(
                    run.id,
                    worker_id=lease.worker_id,
                    error_type="retryable_error",
                    error_message=decision.retry_error,
                    retry_after_seconds=decision.retry_after_seconds,
                    max_attempts=self._max_tries,
                )
                if retried.run is not None and retried.changed:
                    return retried.run, None
                return None, retried.run
            if decision.status is None:
                released = repo.release_lease_for_retry(
                    run.id,
                    worker_id=lease.worker_id,
                    error_type=decision.error_type,
                    error_message=decision.error_message,
                )
                if released:
                    return repo.get_run(run.id) or run, None
                return None, repo.get_run(run.id)
            transition = repo.set_terminal_status(
                run.id,
                status=decision.status,
                worker_id=lease.worker_id,
                error_type=decision.error_type,
                error_message=decision.error_message,
                output=decision.output,
            )
            if transition.run is not None and transition.changed:
                return transition.run, None
            return None, transition.run

    def _confirm(self, run_id: str, lease: Lease, decision: Decision) -> AgentRun | None:
        """After a lost reply: the run if our attempt already finished as decided (a read)."""
        expected = {
            AttemptOutcome.RETRY_RELEASED
            if decision.status is None
            else AttemptOutcome(decision.status.value)
        }
        if decision.retry_error is not None:  # the policy chose between the two
            expected = {AttemptOutcome.RETRY_RELEASED, AttemptOutcome.FAILED}
        try:
            with self._repository() as repo:
                for attempt in repo.list_run_attempts(run_id):
                    if attempt.worker_id == lease.worker_id and attempt.outcome in expected:
                        if repo.telemetry is not None:  # its end committed, the reply was lost
                            repo.telemetry.ended(
                                lease.worker_id, str(attempt.outcome), attempt.error_type
                            )
                        return repo.get_run(run_id)
        except DB_ERRORS:
            pass
        return None

    def reread(self, run: AgentRun) -> AgentRun:
        """The run as the database has it now (a read, never a write); the snapshot on failure."""
        try:
            with self._repository() as repo:
                return repo.get_run(run.id) or run
        except DB_ERRORS:
            return run


def release_unstarted(
    claimed: Sequence[Claimed], *, completer: Completer, heartbeat: HeartbeatService
) -> None:
    """Release for retry runs that were claimed and never started (no thread is left to take
    them, or the worker stops); each lease is untracked once nothing is left to write for it."""
    for one in claimed:
        tag = f"run {one.run.id} ({one.lease.worker_id})"
        log.info("%s: no thread left to execute it; releasing", tag)
        try:
            completer.finish(one.run, one.lease, RELEASE, tag)
        except Exception:  # the others are still released; this one's lease expires
            log.exception("%s: could not release it", tag)
        finally:
            heartbeat.untrack(one.lease)


def _cancel_arrived(current: AgentRun | None, lease: Lease, decision: Decision) -> bool:
    """A cancel request that arrived after the last heartbeat: the run ends `cancelled`."""
    return (
        current is not None
        and current.status == RunStatus.CANCEL_REQUESTED
        and current.worker_id == lease.worker_id
        and decision.status != RunStatus.CANCELLED
    )


def _error(decision: Decision) -> str:
    return f" ({decision.error_type}: {decision.error_message})" if decision.error_type else ""
