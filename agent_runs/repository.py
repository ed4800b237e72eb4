"""AgentRunRepository: every transition of a run and its attempts, one SQL file each.

One class per table pair on purpose: each public method is a short validation block around one
sql/ file; the operator's queries (operations.py) and create_runs (fanout.py) are mixed in.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, LiteralString

import psycopg
from psycopg import errors as pg_errors
from psycopg.types.json import Jsonb

from agent_runs import validation as check
from agent_runs.errors import (
    UQ_ONE_ACTIVE_PER_THREAD,
    UQ_ONE_OPEN_ATTEMPT,
    UQ_RUN_ATTEMPT_NO,
    InvalidArgument,
    NotLeaseOwner,
    ThreadBusy,
)
from agent_runs.fanout import RunBatches
from agent_runs.ids import new_run_id
from agent_runs.models import (
    AgentRun,
    Claim,
    ClaimedRun,
    Finish,
    RunAttempt,
    RunStatus,
    Transition,
)
from agent_runs.operations import OperatorQueries
from agent_runs.rows import attempt_of as _attempt
from agent_runs.rows import run_of as _run
from agent_runs.rows import utc as _aware
from agent_runs.sql import query
from agent_runs.transport import Channel, Row, pooled, rows_of, statement
from agent_runs.turns import one_call_at_a_time as _one_call_at_a_time
from agent_runs.turns import turns

if TYPE_CHECKING:  # never imported at run time: telemetry off costs no import
    from agent_runs.telemetry import Telemetry

LEASE_EXPIRED_MESSAGE: Final = (
    "the worker's lease expired before it reported a result: the outcome is unknown. Under "
    "at-least-once semantics the agent may have run partly or fully; check its side effects "
    "before running it again."
)

# A claim computes attempt_no = max + 1 from its statement's snapshot. If another claimer
# committed a claim *and* a release between that snapshot and our lock, the database refuses
# the duplicate; a new statement (new snapshot) then sees it. Bounded: the race is rare.
_CLAIM_RACE_CONSTRAINTS: Final = frozenset({UQ_RUN_ATTEMPT_NO, UQ_ONE_OPEN_ATTEMPT})
_CLAIM_TRIES: Final = 5


class AgentRunRepository(OperatorQueries, RunBatches):
    """The data access object for agent_runs and agent_run_attempts over one psycopg connection.

    Every method runs in its own explicit transaction, which becomes a savepoint inside a
    transaction the caller already has open. Each transition locks the run row first and
    changes the run and its attempt in that one transaction (one statement, one round trip:
    see agent_runs.transport).
    """

    def __init__(
        self, conn: psycopg.Connection[Any], *, telemetry: Telemetry | None = None
    ) -> None:
        self.conn = conn
        # OpenTelemetry spans and metrics (agent_runs.telemetry); None: off, one check per call.
        self.telemetry = telemetry
        if telemetry is not None and not pooled(conn):  # a pool's goes back: not for gauges
            telemetry.observe_through(conn)
        # Each thread's Channel to the connection: its adapters, reused across calls.
        self._local = threading.local()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """A transaction of yours around several calls that holds the connection's turn: calls
        from other threads sharing the connection wait until it ends instead of running inside
        it. (A plain `conn.transaction()` belongs to the connection: calls from any thread made
        while it is open become savepoints in it.)"""
        with turns(self.conn), self.conn.transaction():
            yield

    # -- plumbing --------------------------------------------------------------------------

    def _execute(self, name: LiteralString, params: Mapping[str, Any]) -> list[Row]:
        """Run sql/<name>.sql in its own explicit transaction and return its rows."""
        stmt = statement(name)
        rows = self._channel().execute(stmt, [params[param] for param in stmt.params])
        if rows is not None:
            return rows
        # Inside the caller's transaction this is a savepoint around the statement. Never
        # prepared: psycopg's statement names (_pg3_0, …) say nothing of their SQL, so behind a
        # pooler another client's statement of the same name could answer.
        with self.conn.transaction():
            cur = self.conn.cursor()
            cur.execute(query(name), params, prepare=False)
            return rows_of(cur)

    def _channel(self) -> Channel:
        local = self._local
        channel: Channel | None = getattr(local, "channel", None)
        if channel is None or channel.conn is not self.conn:
            channel = local.channel = Channel(self.conn)
        return channel

    def _claim(self, name: LiteralString, params: Mapping[str, Any]) -> list[Row]:
        for tries_left in range(_CLAIM_TRIES - 1, -1, -1):
            try:
                return self._execute(name, params)
            except pg_errors.UniqueViolation as exc:
                if exc.diag.constraint_name not in _CLAIM_RACE_CONSTRAINTS or not tries_left:
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    # -- creating and reading -----------------------------------------------------------

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
    ) -> AgentRun:
        """Create a pending run; the same request_id again returns the existing run.

        Raises ThreadBusy when another non-terminal run exists on (uid, agent_slug, thread_id).
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
        }
        if params["created_by_run_id"] is not None and params["created_by_run_id"] == run_id:
            raise InvalidArgument(
                f"created_by_run_id {created_by_run_id!r} is the run's own run_id: a run cannot "
                "be its own parent"
            )
        telemetry = self.telemetry
        if telemetry is None:
            return self._create_run("create_run", params)[0]
        with telemetry.sending(str(params["agent_slug"]), str(params["run_id"])) as sending:
            carried = sending.trace_context
            params["trace_context"] = None if carried is None else Jsonb(carried)
            run, created = self._create_run("create_run", params)
            sending.sent(run, created=created)
            return run

    def _create_run(self, name: LiteralString, params: dict[str, Any]) -> tuple[AgentRun, bool]:
        """create_run's statements (`name`, then `name`.existing): (the run, whether this call
        created it)."""
        thread_id, agent_slug, uid = params["thread_id"], params["agent_slug"], params["uid"]
        request_id, run_id = params["request_id"], params["run_id"]
        created_by_run_id = params["created_by_run_id"]
        try:
            rows = self._execute(name, params)
            if rows:
                return _run(rows[0]), True
            # request_id seen before: a new statement sees its run
            rows = self._execute("create_run.existing", params)
            if not rows:  # pragma: no cover - the other run was deleted in between
                raise InvalidArgument(f"request_id {request_id!r} is being reused; retry")
            return _run(rows[0]), False
        except pg_errors.UniqueViolation as exc:
            # A concurrent create with the same request_id can trip the thread index before
            # ON CONFLICT sees the request_id: idempotency is checked first, so look again.
            existing = self._execute("create_run.existing", params)
            if existing:
                return _run(existing[0]), False
            if exc.diag.constraint_name == UQ_ONE_ACTIVE_PER_THREAD:
                raise ThreadBusy(
                    f"thread {thread_id!r} of uid {uid!r} already has an active run of agent "
                    f"{agent_slug!r}"
                ) from None
            if exc.diag.constraint_name == "agent_runs_pkey":
                raise InvalidArgument(f"run_id {run_id!r} already exists") from None
            raise
        except pg_errors.ForeignKeyViolation:
            raise InvalidArgument(
                f"created_by_run_id {created_by_run_id!r} is not an existing run"
            ) from None

    def get_run(self, run_id: str) -> AgentRun | None:
        rows = self._execute("get_run", {"run_id": check.identifier("run_id", run_id)})
        return _run(rows[0]) if rows else None

    def get_run_by_owner(self, worker_id: str) -> AgentRun | None:
        """The live run whose lease this owner token holds, if any (e.g. after a lost reply)."""
        rows = self._execute("get_run_by_owner", {"worker_id": check.worker_id(worker_id)})
        if not rows:
            return None
        run = _run(rows[0])
        if self.telemetry is not None:  # a claim whose reply was lost: its span starts now
            self.telemetry.claimed([(run, None)], {})
        return run

    def list_run_attempts(self, run_id: str) -> list[RunAttempt]:
        rows = self._execute("list_run_attempts", {"run_id": check.identifier("run_id", run_id)})
        return [_attempt(row) for row in rows]

    def get_open_attempt(self, run_id: str) -> RunAttempt | None:
        rows = self._execute("get_open_attempt", {"run_id": check.identifier("run_id", run_id)})
        return _attempt(rows[0]) if rows else None

    # -- ownership -----------------------------------------------------------------------

    def mark_running(
        self,
        run_id: str,
        *,
        worker_id: str,
        lease_seconds: float,
        now: datetime | None = None,
    ) -> Claim:
        """Claim a run (initial claim) or refresh the lease of its same live owner."""
        rows = self._claim(
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
        run = _run(row)
        acquired = bool(row["acquired"])
        if self.telemetry is not None and acquired and row["initial_claim"]:
            self.telemetry.claimed([(run, None)], {})  # attempt_no: not in this answer
        return Claim(run, acquired)

    def claim_next(
        self,
        *,
        worker_id: str,
        lease_seconds: float,
        now: datetime | None = None,
        agent_slugs: list[str] | None = None,
    ) -> AgentRun | None:
        """Claim the oldest claimable run (FIFO by created_at, id), or None when there is none."""
        row = self._claim_next("claim_next", worker_id, lease_seconds, now, agent_slugs)
        if row is None:
            return None
        run = _run(row)
        if self.telemetry is not None:
            self._claimed([ClaimedRun(run, int(row["attempt_no"]))])
        return run

    def claim_next_attempt(
        self,
        *,
        worker_id: str,
        lease_seconds: float,
        now: datetime | None = None,
        agent_slugs: list[str] | None = None,
    ) -> ClaimedRun | None:
        """claim_next that also answers the attempt_no it opened (no second read needed)."""
        row = self._claim_next("claim_next", worker_id, lease_seconds, now, agent_slugs)
        if row is None:
            return None
        claimed = ClaimedRun(_run(row), int(row["attempt_no"]))
        if self.telemetry is not None:
            self._claimed([claimed])
        return claimed

    def claim_next_attempts(
        self,
        *,
        worker_ids: Sequence[str],
        lease_seconds: float,
        now: datetime | None = None,
        agent_slugs: list[str] | None = None,
    ) -> list[ClaimedRun]:
        """claim_next for up to one run per owner token, in one statement: the n-th oldest
        claimable run goes to worker_ids[n], each with claim_next's rules and attempt facts;
        fewer (or none) when fewer are claimable. In FIFO order."""
        rows = self._claim(
            "claim_next_attempts",
            {
                "worker_ids": check.worker_ids(worker_ids),
                **check.lease(lease_seconds, now),
                "agent_slugs": check.agent_slugs(agent_slugs),
                "lost_message": LEASE_EXPIRED_MESSAGE,
            },
        )
        claimed = [ClaimedRun(_run(row), int(row["attempt_no"])) for row in rows]
        claimed.sort(key=lambda c: (c.run.created_at, c.run.id))
        if self.telemetry is not None and claimed:
            self._claimed(claimed)
        return claimed

    def _claimed(self, claimed: Sequence[ClaimedRun]) -> None:
        """Telemetry of committed claims; a retry's pickup starts when the attempt before it
        ended, read in one statement (telemetry on, retries only)."""
        assert self.telemetry is not None
        retries = [c for c in claimed if c.attempt_no > 1]
        released: dict[str, datetime] = {}
        if retries:
            rows = self._execute(
                "claim_next.released",
                {
                    "run_ids": [c.run.id for c in retries],
                    "attempt_nos": [c.attempt_no for c in retries],
                },
            )
            released = {row["run_id"]: _aware(row["finished_at"]) for row in rows}
        self.telemetry.claimed(claimed, released)

    def _claim_next(
        self,
        name: LiteralString,
        worker_id: str,
        lease_seconds: float,
        now: datetime | None,
        agent_slugs: list[str] | None,
    ) -> Row | None:
        rows = self._claim(
            name,
            {
                "worker_id": check.worker_id(worker_id),
                **check.lease(lease_seconds, now),
                "agent_slugs": check.agent_slugs(agent_slugs),
                "lost_message": LEASE_EXPIRED_MESSAGE,
            },
        )
        return rows[0] if rows else None

    def renew_lease(
        self,
        run_id: str,
        *,
        worker_id: str,
        lease_seconds: float,
        now: datetime | None = None,
    ) -> bool:
        """Extend the live lease of its owner (run and open attempt); False when not the owner."""
        rows = self._execute(
            "renew_lease",
            {
                "run_id": check.identifier("run_id", run_id),
                "worker_id": check.worker_id(worker_id),
                **check.lease(lease_seconds, now),
            },
        )
        if self.telemetry is not None and rows:
            self.telemetry.renewed(1)
        return bool(rows)

    def renew_leases(
        self,
        leases: Mapping[str, str],
        *,
        lease_seconds: float,
        now: datetime | None = None,
    ) -> dict[str, RunStatus]:
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
        rows = self._execute("renew_leases", params)
        if self.telemetry is not None and rows:
            self.telemetry.renewed(len(rows))
        return {row["id"]: RunStatus(row["status"]) for row in rows}

    def release_lease_for_retry(
        self,
        run_id: str,
        *,
        worker_id: str,
        error_type: str | None = None,
        error_message: str | None = None,
        now: datetime | None = None,
    ) -> bool:
        """Give a running run back to the queue (pending); the attempt ends retry_released,
        with the error that made it retry when one is given (the run keeps none)."""
        rows = self._execute(
            "release_lease_for_retry",
            {
                "run_id": check.identifier("run_id", run_id),
                "worker_id": check.worker_id(worker_id),
                "error_type": check.error_type(error_type),
                "error_message": check.error_message(error_message),
                "now": check.now(now),
            },
        )
        if self.telemetry is not None and rows:
            self.telemetry.ended(worker_id, "retry_released", error_type)
        return bool(rows)

    # -- finishing -----------------------------------------------------------------------

    def set_terminal_status(
        self,
        run_id: str,
        *,
        status: RunStatus | str,
        worker_id: str | None = None,
        error_type: str | None = None,
        error_message: str | None = None,
        now: datetime | None = None,
    ) -> Transition:
        """Finish a run (and its owner's attempt) when the transition rules allow it."""
        rows = self._execute(
            "set_terminal_status",
            {
                "run_id": check.identifier("run_id", run_id),
                "status": check.terminal_status(status).value,
                "worker_id": check.optional_worker_id(worker_id),
                "error_type": check.error_type(error_type),
                "error_message": check.error_message(error_message),
                "now": check.now(now),
            },
        )
        if not rows:
            return Transition(None, False)
        transition = Transition(_run(rows[0]), bool(rows[0]["changed"]))
        if self.telemetry is not None and transition.changed and worker_id is not None:
            self.telemetry.ended(worker_id, str(status), error_type)
        return transition

    def finish_runs(
        self, finishes: Sequence[Finish], *, now: datetime | None = None
    ) -> dict[str, datetime]:
        """set_terminal_status for many runs of their owners, in one statement (each run under
        its own lock and rule). The lean answer: run_id -> finished_at of each run finished; a
        refused or missing run is absent (ask set_terminal_status or get_run why)."""
        run_ids, worker_ids, statuses, error_types, error_messages = check.finishes(finishes)
        rows = self._execute(
            "finish_runs",
            {
                "run_ids": run_ids,
                "worker_ids": worker_ids,
                "statuses": statuses,
                "error_types": error_types,
                "error_messages": error_messages,
                "now": check.now(now),
            },
        )
        finished = {row["id"]: _aware(row["finished_at"]) for row in rows}
        if self.telemetry is not None:
            for finish in finishes:
                if finish.run_id in finished:
                    self.telemetry.ended(finish.worker_id, str(finish.status), finish.error_type)
        return finished

    def request_cancel(self, run_id: str, *, now: datetime | None = None) -> AgentRun | None:
        """Cancel a run that never started; ask the owner of any other live run to cancel."""
        rows = self._execute(
            "request_cancel",
            {"run_id": check.identifier("run_id", run_id), "now": check.now(now)},
        )
        return _run(rows[0]) if rows else None

    def reconcile_expired_leases(
        self, *, now: datetime | None = None, limit: int = 500
    ) -> list[AgentRun]:
        """Fail every run that lost its owner (at most `limit`); returns them as converged."""
        params = {
            "now": check.now(now),
            "limit": check.limit(limit),
            "lost_message": LEASE_EXPIRED_MESSAGE,
        }
        telemetry = self.telemetry
        started_ns = 0 if telemetry is None else telemetry.clock_ns()
        with self.conn.transaction():
            cur = self.conn.cursor()
            lock = query("reconcile_expired_leases.lock")
            locked = cur.execute(lock, params, prepare=False).fetchall()
            if not locked:
                return []
            run_ids = [run_id for (run_id,) in locked]
            cur.execute(
                query("reconcile_expired_leases"), {**params, "run_ids": run_ids}, prepare=False
            )
            converged = [_run(row) for row in rows_of(cur)]
            if telemetry is None or not converged:
                return converged
            # Telemetry only: the attempts this pass closed, for their durations (one read).
            closed = cur.execute(
                query("reconcile_expired_leases.attempts"),
                {
                    "run_ids": [run.id for run in converged],
                    "finished_ats": [run.finished_at for run in converged],
                },
                prepare=False,
            ).fetchall()
        telemetry.reconciled(converged, closed, started_ns)
        return converged

    def record_run_manifest(
        self,
        run_id: str,
        *,
        manifest: Mapping[str, Any],
        fingerprint: str,
        worker_id: str,
        now: datetime | None = None,
    ) -> Transition:
        """Record the run manifest once, by the live owner of the running run."""
        rows = self._execute(
            "record_run_manifest",
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
        return Transition(_run(row), bool(row["changed"]))


_one_call_at_a_time(AgentRunRepository)
