"""The operator's queries: list runs, cancel a run tree, statistics, retention.

`OperatorQueries` is a mixin of `AgentRunRepository`: it runs its SQL through the repository's
plumbing (`_execute`: one explicit transaction per call, a savepoint inside the caller's).
Its length is the four queries' typed values and argument checks, kept beside the queries.
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final, LiteralString, TypedDict

from agent_runs import validation as check
from agent_runs.durations import MAX_DURATION
from agent_runs.errors import InvalidArgument
from agent_runs.models import AgentRun, RunStatus
from agent_runs.rows import run_of as _run
from agent_runs.sql import query
from agent_runs.transport import Row, rows_of
from agent_runs.turns import turns

if TYPE_CHECKING:
    import psycopg
    from typing_extensions import Unpack  # annotations only: no runtime dependency

MAX_LIST_LIMIT: Final = 1000
MAX_BATCH_SIZE: Final = 100_000
DEFAULT_STUCK_AFTER: Final = timedelta(minutes=15)
# How many error types and worker identities run_stats reports, the most frequent first.
STATS_TOP: Final = 20
_LIVE: Final = frozenset({RunStatus.PENDING, RunStatus.RUNNING})


class RunFilters(TypedDict, total=False):
    """The filters of `list_runs`, by keyword."""

    statuses: Iterable[RunStatus | str] | None
    agent_slug: str | None
    thread_id: str | None
    uid: str | None
    worker: str | None
    since: datetime | timedelta | None
    stuck: bool
    stuck_after: timedelta
    limit: int
    before: str | None
    now: datetime | None


@dataclass(frozen=True, slots=True)
class RunSummary:
    """A run as listed: the run, how many attempts it has, and its last attempt's owner."""

    run: AgentRun
    attempt_count: int
    last_worker_id: str | None


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One worker identity's attempts finished in the window, by what became of them."""

    worker: str
    attempts: int
    completions: int
    failures: int
    lease_losses: int
    retries: int


@dataclass(frozen=True, slots=True)
class AttemptDurations:
    """Seconds from start to finish of the attempts finished in the window."""

    p50: float
    p95: float
    max: float


@dataclass(frozen=True, slots=True)
class QueueNow:
    """The queue at the moment of the call, whatever the window."""

    pending: int
    oldest_pending_age: timedelta | None
    running: int
    expired_unreconciled: int


@dataclass(frozen=True, slots=True)
class RunStats:
    """run_stats: the window [window_start, now] (window_start None: all history)."""

    window_start: datetime | None
    now: datetime
    runs_by_status: Mapping[str, int]
    attempts_by_outcome: Mapping[str, int]
    top_error_types: Mapping[str, int]
    workers: tuple[WorkerStats, ...]
    durations: AttemptDurations | None
    queue: QueueNow


@dataclass(frozen=True, slots=True)
class PruneBatch:
    """One batch of prune_finished_runs: what went (or would go, in a dry run)."""

    runs: int
    attempts: int
    examined: int
    cutoff: datetime


def runs_cursor(run: AgentRun) -> str:
    """The keyset cursor after `run`: pass it as `before` to get the next (older) page."""
    raw = json.dumps([run.created_at.astimezone(UTC).isoformat(), run.id])
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


def _decode_cursor(value: object) -> tuple[datetime, str]:
    bad = InvalidArgument("before must be a cursor given by a previous page of runs")
    if not isinstance(value, str) or not 0 < len(value) <= 512:
        raise bad
    try:
        raw = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4))
        created, run_id = json.loads(raw)
        created_at = datetime.fromisoformat(created)
    except (binascii.Error, ValueError, TypeError):
        raise bad from None
    if created_at.tzinfo is None or not isinstance(run_id, str):
        raise bad
    return created_at, check.identifier("before", run_id)


def _span(name: str, value: object, *, allow_zero: bool = False) -> float:
    """A timedelta as seconds: > 0 (or >= 0) and at most 100 years."""
    if not isinstance(value, timedelta):
        raise InvalidArgument(f"{name} must be a timedelta, got {type(value).__name__}")
    if value < timedelta(0) or (value == timedelta(0) and not allow_zero) or value > MAX_DURATION:
        low = ">= 0" if allow_zero else "> 0"
        raise InvalidArgument(f"{name} must be {low} and at most {MAX_DURATION.days} days")
    return value.total_seconds()


def _since(value: object) -> tuple[datetime | None, float | None]:
    """since: an aware datetime (since_at) or a timedelta back from now (since_seconds)."""
    if value is None:
        return None, None
    if isinstance(value, datetime):
        return check.instant("since", value), None
    if isinstance(value, timedelta):
        return None, _span("since", value, allow_zero=True)
    raise InvalidArgument(f"since must be an aware datetime or a timedelta, not {value!r}")


def _statuses(value: object) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Iterable):
        raise InvalidArgument("statuses must be a collection of run statuses or None")
    found: list[str] = []
    for item in value:
        try:
            found.append(RunStatus(item).value)
        except ValueError:
            raise InvalidArgument(f"statuses: {item!r} is not a run status") from None
    if not found:
        raise InvalidArgument("statuses must not be empty (use None for every status)")
    return found


def _bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgument(f"{name} must be True or False, got {value!r}")
    return value


def _counts(rows: list[Row]) -> dict[str, int]:
    return {str(row["key"]): int(row["n"]) for row in rows}


class OperatorQueries:
    """list_runs, request_cancel_tree, run_stats and prune_finished_runs of the repository."""

    if TYPE_CHECKING:
        conn: psycopg.Connection[Any]

        def _execute(self, name: LiteralString, params: Mapping[str, Any]) -> list[Row]: ...

        def request_cancel(
            self, run_id: str, *, now: datetime | None = None
        ) -> AgentRun | None: ...

    # -- listing -------------------------------------------------------------------------

    def list_runs(
        self,
        *,
        statuses: Iterable[RunStatus | str] | None = None,
        agent_slug: str | None = None,
        thread_id: str | None = None,
        uid: str | None = None,
        worker: str | None = None,
        since: datetime | timedelta | None = None,
        stuck: bool = False,
        stuck_after: timedelta = DEFAULT_STUCK_AFTER,
        limit: int = 50,
        before: str | None = None,
        now: datetime | None = None,
    ) -> list[AgentRun]:
        """Runs newest first by (created_at, id), every given filter applied; `before` is the
        cursor of the previous page's last run (`runs_cursor`).

        worker: runs with an attempt whose owner token, without its last ':' part, is exactly
        this identity. stuck: live leases expired and not reconciled yet, and pending runs
        created more than `stuck_after` ago.
        """
        rows = self._list_rows(
            statuses=statuses,
            agent_slug=agent_slug,
            thread_id=thread_id,
            uid=uid,
            worker=worker,
            since=since,
            stuck=stuck,
            stuck_after=stuck_after,
            limit=limit,
            before=before,
            now=now,
        )
        return [_run(row) for row in rows]

    def list_run_summaries(self, **filters: Unpack[RunFilters]) -> list[RunSummary]:
        """list_runs (same keyword arguments) with each run's attempt count and last owner."""
        return [
            RunSummary(_run(row), int(row["attempt_count"]), row["last_worker_id"])
            for row in self._list_rows(**filters)
        ]

    def _list_rows(self, **filters: Unpack[RunFilters]) -> list[Row]:
        since_at, since_seconds = _since(filters.get("since"))
        before = filters.get("before")
        before_created_at, before_id = (None, None) if before is None else _decode_cursor(before)
        worker = filters.get("worker")
        params = {
            "statuses": _statuses(filters.get("statuses")),
            "agent_slug": check.optional_identifier("agent_slug", filters.get("agent_slug")),
            "thread_id": check.optional_identifier("thread_id", filters.get("thread_id")),
            "uid": check.optional_identifier("uid", filters.get("uid")),
            "worker": None if worker is None else check.worker_id(worker, "worker"),
            "since_at": since_at,
            "since_seconds": since_seconds,
            "stuck": _bool("stuck", filters.get("stuck", False)),
            "stuck_after_seconds": _span(
                "stuck_after", filters.get("stuck_after", DEFAULT_STUCK_AFTER), allow_zero=True
            ),
            "limit": check.integer("limit", filters.get("limit", 50), 1, MAX_LIST_LIMIT),
            "before_created_at": before_created_at,
            "before_id": before_id,
            "now": check.now(filters.get("now")),
        }
        return self._execute("list_runs", params)

    # -- cancelling a tree ---------------------------------------------------------------

    def request_cancel_tree(self, run_id: str, *, now: datetime | None = None) -> list[AgentRun]:
        """request_cancel for the run and every run created by it, recursively (below terminal
        runs too), in one transaction, each run under its own row lock. Returns the runs whose
        status changed (parents first); InvalidArgument for an unknown run."""
        params = {"run_id": check.identifier("run_id", run_id), "now": check.now(now)}
        changed: list[AgentRun] = []
        with self.conn.transaction():
            cur = self.conn.cursor()
            tree: list[Row] = []
            # Again until nothing new: each statement sees the children committed before it,
            # and a locked run gets no new child until this transaction ends.
            while True:
                cur.execute(query("request_cancel_tree"), params, prepare=False)
                found = rows_of(cur)
                if len(found) == len(tree):
                    break
                tree = found
            if not tree:
                raise InvalidArgument(f"run_id {run_id!r} is not an existing run")
            for row in sorted(tree, key=lambda r: (r["created_at"], r["id"])):
                if row["status"] in _LIVE:  # under our lock: a cancel request changes it
                    run = self.request_cancel(row["id"], now=now)
                    if run is not None:
                        changed.append(run)
        return changed

    # -- statistics ----------------------------------------------------------------------

    def run_stats(
        self, *, since: datetime | timedelta | None = None, now: datetime | None = None
    ) -> RunStats:
        """Runs by final status, attempts by outcome, top error types, per worker identity,
        attempt durations (all over the window since `since`, None: all history) and the
        queue now."""
        since_at, since_seconds = _since(since)
        params: dict[str, Any] = {
            "since_at": since_at,
            "since_seconds": since_seconds,
            "now": check.now(now),
            "top": STATS_TOP,
        }
        with self.conn.transaction():
            cur = self.conn.cursor()

            def rows(sql: LiteralString) -> list[Row]:
                cur.execute(sql, params, prepare=False)
                return rows_of(cur)

            head = rows(query("run_stats"))[0]
            # The parts count over the window the head computed, on the same clock.
            params["window_start"] = head["window_start"]
            by_status = _counts(rows(query("run_stats.runs")))
            by_outcome = _counts(rows(query("run_stats.outcomes")))
            errors = _counts(rows(query("run_stats.errors")))
            workers = tuple(
                WorkerStats(
                    worker=row["worker"],
                    attempts=int(row["attempts"]),
                    completions=int(row["completions"]),
                    failures=int(row["failures"]),
                    lease_losses=int(row["lease_losses"]),
                    retries=int(row["retries"]),
                )
                for row in rows(query("run_stats.workers"))
            )
        clock: datetime = head["now"].astimezone(UTC)
        start: datetime | None = head["window_start"]
        oldest: datetime | None = head["oldest_pending_created_at"]
        durations = None
        if head["duration_max"] is not None:
            durations = AttemptDurations(
                float(head["duration_p50"]),
                float(head["duration_p95"]),
                float(head["duration_max"]),
            )
        return RunStats(
            window_start=None if start is None else start.astimezone(UTC),
            now=clock,
            runs_by_status=by_status,
            attempts_by_outcome=by_outcome,
            top_error_types=errors,
            workers=workers,
            durations=durations,
            queue=QueueNow(
                pending=int(head["pending"]),
                oldest_pending_age=None if oldest is None else max(clock - oldest, timedelta(0)),
                running=int(head["running"]),
                expired_unreconciled=int(head["expired_unreconciled"]),
            ),
        )

    # -- retention -----------------------------------------------------------------------

    def prune_finished_runs(
        self, *, older_than: timedelta, batch_size: int = 1000, now: datetime | None = None
    ) -> int:
        """Delete terminal runs finished before `now - older_than` (with their attempts), in
        batches of at most `batch_size` trees, each batch its own short transaction that takes
        only rows nobody holds. A run goes only together with every run created by it
        (recursively): a tree with a live or recent member waits. Returns the runs deleted."""
        return sum(
            batch.runs
            for batch in self.prune_batches(older_than=older_than, batch_size=batch_size, now=now)
        )

    def prune_batches(
        self,
        *,
        older_than: timedelta,
        batch_size: int = 1000,
        now: datetime | None = None,
        dry_run: bool = False,
    ) -> Iterator[PruneBatch]:
        """prune_finished_runs one batch at a time (for progress); dry_run deletes nothing and
        yields what would go. The cutoff is fixed by the first batch."""
        params: dict[str, Any] = {
            "older_than_seconds": _span("older_than", older_than, allow_zero=True),
            "batch_size": check.integer("batch_size", batch_size, 1, MAX_BATCH_SIZE),
            "now": check.now(now),
            "dry_run": _bool("dry_run", dry_run),
            "cutoff": None,
            "after_finished_at": None,
            "after_id": None,
        }
        return self._prune(params)

    def _prune(self, params: dict[str, Any]) -> Iterator[PruneBatch]:
        while True:
            row, removed = self._prune_batch(params)
            examined = int(row["examined"])
            cutoff: datetime = row["cutoff"]
            batch = PruneBatch(
                runs=int(removed["deleted"] if not params["dry_run"] else removed["runs"]),
                attempts=int(removed["attempts"]),
                examined=examined,
                cutoff=cutoff.astimezone(UTC),
            )
            if examined:
                yield batch
            if examined < params["batch_size"]:
                return
            params["cutoff"] = cutoff
            params["after_finished_at"] = row["last_finished_at"]
            params["after_id"] = row["last_id"]

    def _prune_batch(self, params: dict[str, Any]) -> tuple[Row, Row]:
        """One batch in its own transaction: lock whole trees, then (a new statement, so a new
        snapshot) check nothing was added below them, and delete."""
        with turns(self.conn), self.conn.transaction():
            cur = self.conn.cursor()
            cur.execute(query("prune_finished_runs"), params, prepare=False)
            [row] = rows_of(cur)
            cur.execute(
                query("prune_finished_runs.delete"),
                {"ids": row["ids"], "roots": row["roots"], "dry_run": params["dry_run"]},
                prepare=False,
            )
            [removed] = rows_of(cur)
        return row, removed
