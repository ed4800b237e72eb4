"""The operator's queries: list runs, cancel a run tree, statistics, retention.

Plans (agent_runs.steps) that both repository faces drive; their arguments are checked by
agent_runs.validation (the filters in validation.filters), their typed values are in
agent_runs.operator_values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, Final

from agent_runs import validation as check
from agent_runs.cursors import decode_cursor, runs_cursor
from agent_runs.errors import InvalidArgument
from agent_runs.models import AgentRun, RunStatus
from agent_runs.operator_values import (
    AttemptDurations,
    PruneBatch,
    QueueNow,
    RunListing,
    RunStats,
    RunSummary,
    WorkerStats,
)
from agent_runs.rows import listing_of, run_of
from agent_runs.steps import (
    Emit,
    Execute,
    Plan,
    Stream,
    Transaction,
    planned,
    planned_stream,
)
from agent_runs.transport import Row, statement

if TYPE_CHECKING:
    from typing_extensions import Unpack  # annotations only: no runtime dependency

    from agent_runs.operator_values import RunFilters

__all__ = [
    "AttemptDurations",
    "OperatorQueries",
    "PruneBatch",
    "QueueNow",
    "RunListing",
    "RunStats",
    "RunSummary",
    "WorkerStats",
    "runs_cursor",
]

MAX_LIST_LIMIT: Final = 1000
MAX_BATCH_SIZE: Final = 100_000
DEFAULT_STUCK_AFTER: Final = timedelta(minutes=15)
# How many error types and worker identities run_stats reports, the most frequent first.
STATS_TOP: Final = 20
_LIVE: Final = frozenset({RunStatus.PENDING, RunStatus.RUNNING})


def _counts(rows: list[Row]) -> dict[str, int]:
    return {str(row["key"]): int(row["n"]) for row in rows}


class OperatorQueries:
    """list_runs, request_cancel_tree, run_stats and prune_finished_runs of the repository
    (plans, see agent_runs.steps)."""

    # -- listing -------------------------------------------------------------------------

    @planned
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
        concurrency_key: str | None = None,
    ) -> Plan[list[AgentRun]]:
        """Runs newest first by (created_at, id), every given filter applied; `before` is the
        cursor of the previous page's last run (`runs_cursor`).

        worker: runs with an attempt whose owner token, without its last ':' part, is exactly
        this identity. stuck: live leases expired and not reconciled yet, and pending runs
        claimable for longer than `stuck_after` (counted from their available_at).
        """
        rows = yield from _list_rows(
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
            concurrency_key=concurrency_key,
        )
        return [run_of(row) for row in rows]

    @planned
    def list_run_summaries(self, **filters: Unpack[RunFilters]) -> Plan[list[RunSummary]]:
        """list_runs (same keyword arguments) with each run's attempt count and last owner."""
        rows = yield from _list_rows(**filters)
        return [
            RunSummary(run_of(row), int(row["attempt_count"]), row["last_worker_id"])
            for row in rows
        ]

    @planned
    def list_run_listings(self, **filters: Unpack[RunFilters]) -> Plan[list[RunListing]]:
        """list_run_summaries without the payloads: only the columns a runs table shows."""
        rows = yield from _list_rows(documents=False, **filters)
        return [listing_of(row) for row in rows]

    # -- cancelling a tree ---------------------------------------------------------------

    @planned
    def request_cancel_tree(
        self, run_id: str, *, now: datetime | None = None
    ) -> Plan[list[AgentRun]]:
        """request_cancel for the run and every run created by it, recursively (below terminal
        runs too), in one transaction, each run under its own row lock. Returns the runs whose
        status changed (parents first); InvalidArgument for an unknown run."""
        params = {"run_id": check.identifier("run_id", run_id), "now": check.now(now)}
        changed: list[AgentRun] = yield Transaction(_cancel_tree(self, params, now))
        return changed

    # -- statistics ----------------------------------------------------------------------

    @planned
    def run_stats(
        self, *, since: datetime | timedelta | None = None, now: datetime | None = None
    ) -> Plan[RunStats]:
        """Runs by final status, attempts by outcome, top error types, per worker identity,
        attempt durations (all over the window since `since`, None: all history) and the
        queue now."""
        since_at, since_seconds = check.since(since)
        params: dict[str, Any] = {
            "since_at": since_at,
            "since_seconds": since_seconds,
            "now": check.now(now),
            "top": STATS_TOP,
        }
        stats: RunStats = yield Transaction(_stats(params))
        return stats

    # -- retention -----------------------------------------------------------------------

    @planned
    def prune_finished_runs(
        self, *, older_than: timedelta, batch_size: int = 1000, now: datetime | None = None
    ) -> Plan[int]:
        """Delete terminal runs finished before `now - older_than` (with their attempts), in
        batches of at most `batch_size` trees, each batch its own short transaction that takes
        only rows nobody holds. A run goes only together with every run created by it
        (recursively): a tree with a live or recent member waits. Returns the runs deleted."""
        batches = _prune(_prune_params(older_than, batch_size, now, dry_run=False))
        deleted, answer = 0, None
        while True:
            try:
                item = batches.send(answer)
            except StopIteration:
                return deleted
            if isinstance(item, Emit):
                deleted, answer = deleted + item.value.runs, None
            else:
                answer = yield item

    @planned_stream
    def prune_batches(
        self,
        *,
        older_than: timedelta,
        batch_size: int = 1000,
        now: datetime | None = None,
        dry_run: bool = False,
    ) -> Stream[PruneBatch]:
        """prune_finished_runs one batch at a time (for progress); dry_run deletes nothing and
        yields what would go. The cutoff is fixed by the first batch."""
        return _prune(_prune_params(older_than, batch_size, now, dry_run=dry_run))


def _cancel_tree(
    face: Any, params: Mapping[str, Any], now: datetime | None
) -> Plan[list[AgentRun]]:
    # The same request_cancel plan, whichever face drives this one.
    cancel = type(face).request_cancel.plan
    tree: list[Row] = []
    # Again until nothing new: each statement sees the children committed before it, and a
    # locked run gets no new child until this transaction ends.
    while True:
        found: list[Row] = yield Execute(statement("request_cancel_tree"), params)
        if len(found) == len(tree):
            break
        tree = found
    if not tree:
        raise InvalidArgument(f"run_id {params['run_id']!r} is not an existing run")
    changed: list[AgentRun] = []
    for row in sorted(tree, key=lambda r: (r["created_at"], r["id"])):
        if row["status"] in _LIVE:  # under our lock: a cancel request changes it
            run = yield from cancel(face, row["id"], now=now)
            if run is not None:
                changed.append(run)
    return changed


def _list_rows(*, documents: bool = True, **filters: Unpack[RunFilters]) -> Plan[list[Row]]:
    since_at, since_seconds = check.since(filters.get("since"))
    before = filters.get("before")
    before_created_at, before_id = (None, None) if before is None else decode_cursor(before)
    worker = filters.get("worker")
    params = {
        "statuses": check.statuses(filters.get("statuses")),
        "agent_slug": check.optional_identifier("agent_slug", filters.get("agent_slug")),
        "thread_id": check.optional_identifier("thread_id", filters.get("thread_id")),
        "uid": check.optional_identifier("uid", filters.get("uid")),
        "worker": None if worker is None else check.worker_id(worker, "worker"),
        "since_at": since_at,
        "since_seconds": since_seconds,
        "stuck": check.flag("stuck", filters.get("stuck", False)),
        "stuck_after_seconds": check.span(
            "stuck_after", filters.get("stuck_after", DEFAULT_STUCK_AFTER), allow_zero=True
        ),
        "limit": check.integer("limit", filters.get("limit", 50), 1, MAX_LIST_LIMIT),
        "before_created_at": before_created_at,
        "before_id": before_id,
        "now": check.now(filters.get("now")),
        "documents": documents,
        "concurrency_key": check.optional_concurrency_key(filters.get("concurrency_key")),
    }
    rows: list[Row] = yield Execute(statement("list_runs"), params)
    return rows


def _stats(params: dict[str, Any]) -> Plan[RunStats]:
    [head] = yield Execute(statement("run_stats"), params)
    # The parts count over the window the head computed, on the same clock.
    params["window_start"] = head["window_start"]
    by_status = _counts((yield Execute(statement("run_stats.runs"), params)))
    by_outcome = _counts((yield Execute(statement("run_stats.outcomes"), params)))
    errors = _counts((yield Execute(statement("run_stats.errors"), params)))
    workers = tuple(
        WorkerStats(
            worker=row["worker"],
            attempts=int(row["attempts"]),
            completions=int(row["completions"]),
            failures=int(row["failures"]),
            lease_losses=int(row["lease_losses"]),
            retries=int(row["retries"]),
        )
        for row in (yield Execute(statement("run_stats.workers"), params))
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


def _prune_params(
    older_than: timedelta, batch_size: int, now: datetime | None, *, dry_run: bool
) -> dict[str, Any]:
    return {
        "older_than_seconds": check.span("older_than", older_than, allow_zero=True),
        "batch_size": check.integer("batch_size", batch_size, 1, MAX_BATCH_SIZE),
        "now": check.now(now),
        "dry_run": check.flag("dry_run", dry_run),
        "cutoff": None,
        "after_finished_at": None,
        "after_id": None,
    }


def _prune(params: dict[str, Any]) -> Stream[PruneBatch]:
    while True:
        row, removed = yield Transaction(_prune_batch(params))
        examined = int(row["examined"])
        cutoff: datetime = row["cutoff"]
        batch = PruneBatch(
            runs=int(removed["deleted"] if not params["dry_run"] else removed["runs"]),
            attempts=int(removed["attempts"]),
            examined=examined,
            cutoff=cutoff.astimezone(UTC),
        )
        if examined:
            yield Emit(batch)
        if examined < params["batch_size"]:
            return
        params["cutoff"] = cutoff
        params["after_finished_at"] = row["last_finished_at"]
        params["after_id"] = row["last_id"]


def _prune_batch(params: dict[str, Any]) -> Plan[tuple[Row, Row]]:
    """One batch in its own transaction: lock whole trees, then (a new statement, so a new
    snapshot) check nothing was added below them, and delete."""
    [row] = yield Execute(statement("prune_finished_runs"), params)
    [removed] = yield Execute(
        statement("prune_finished_runs.delete"),
        {"ids": row["ids"], "roots": row["roots"], "dry_run": params["dry_run"]},
    )
    return row, removed
