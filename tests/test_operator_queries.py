"""The operator's queries on a real PostgreSQL: list_runs filters and keyset pages,
request_cancel_tree (also under concurrent claims and completions), run_stats, and
prune_finished_runs (never a live run, never a cut tree, only rows nobody holds)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

import agent_runs
import agent_runs.sql
from agent_runs import AgentRun, AgentRunRepository, InvalidArgument, RunStatus
from agent_runs.repository.operator_queries import runs_cursor

Conn = psycopg.Connection[Any]
MakeRun = Callable[..., AgentRun]
MakeAttempt = Callable[..., Any]


def ids(runs: list[AgentRun]) -> list[str]:
    return [run.id for run in runs]


def done(make_run: MakeRun, t: datetime, **cols: Any) -> AgentRun:
    """A completed run created at t, finished a minute later."""
    values = {"status": "completed", "created_at": t, "started_at": t}
    values["finished_at"] = t + timedelta(minutes=1)
    values.update(cols)
    return make_run(**values)


# -- list_runs -----------------------------------------------------------------------------------


@pytest.fixture
def listed(make_run: MakeRun, make_attempt: MakeAttempt, t0: datetime) -> dict[str, AgentRun]:
    """Runs of every kind, created a minute apart (oldest first)."""
    t = t0 - timedelta(hours=2)
    runs: dict[str, AgentRun] = {}
    runs["old_pending"] = make_run(created_at=t, agent_slug="alpha", uid="u1", thread_id="th1")
    runs["done_a"] = done(make_run, t + timedelta(minutes=1), agent_slug="alpha", uid="u1")
    runs["failed_b"] = done(
        make_run, t + timedelta(minutes=2), agent_slug="beta", uid="u2", status="failed"
    )
    runs["lost"] = make_run(
        created_at=t + timedelta(minutes=3),
        agent_slug="beta",
        status="running",
        worker_id="host-9:aaa",
        heartbeat_at=t0 - timedelta(minutes=5),
        lease_expires_at=t0 - timedelta(minutes=4),
        started_at=t0 - timedelta(minutes=5),
    )
    runs["live"] = make_run(
        created_at=t + timedelta(minutes=4),
        agent_slug="alpha",
        status="running",
        worker_id="host-1:bbb",
        heartbeat_at=t0,
        lease_expires_at=t0 + timedelta(minutes=5),
        started_at=t0,
    )
    runs["new_pending"] = make_run(created_at=t0 - timedelta(minutes=1), agent_slug="beta")
    make_attempt(
        runs["done_a"].id,
        worker_id="host-1:x1",
        started_at=t,
        finished_at=t,
        outcome="retry_released",
    )
    make_attempt(
        runs["done_a"].id, worker_id="host-10:x2", started_at=t, finished_at=t, outcome="completed"
    )
    make_attempt(
        runs["failed_b"].id,
        worker_id="pool:a:host-1:x3",
        started_at=t,
        finished_at=t,
        outcome="failed",
    )
    make_attempt(runs["lost"].id, worker_id="host-9:aaa", started_at=t)
    make_attempt(runs["live"].id, worker_id="host-1:bbb", started_at=t0)
    return runs


def test_list_runs_is_newest_first_with_attempt_counts(
    repo: AgentRunRepository, listed: dict[str, AgentRun], t0: datetime
) -> None:
    order = ["new_pending", "live", "lost", "failed_b", "done_a", "old_pending"]
    assert ids(repo.list_runs(now=t0)) == [listed[k].id for k in order]
    [summary] = [s for s in repo.list_run_summaries(now=t0) if s.run.id == listed["done_a"].id]
    assert (summary.attempt_count, summary.last_worker_id) == (2, "host-10:x2")


@pytest.mark.parametrize(
    ("filters", "expected"),
    [
        ({"statuses": ["pending"]}, ["new_pending", "old_pending"]),
        ({"statuses": ("completed", RunStatus.FAILED)}, ["failed_b", "done_a"]),
        ({"agent_slug": "alpha"}, ["live", "done_a", "old_pending"]),
        ({"uid": "u2"}, ["failed_b"]),
        ({"thread_id": "th1"}, ["old_pending"]),
        # The identity is the token without its last ':' part, matched exactly.
        ({"worker": "host-1"}, ["live", "done_a"]),
        ({"worker": "host-10"}, ["done_a"]),
        ({"worker": "pool:a:host-1"}, ["failed_b"]),
        ({"worker": "host"}, []),
        ({"since": timedelta(minutes=30)}, ["new_pending"]),
        ({"stuck": True}, ["lost", "old_pending"]),
        (
            {"stuck": True, "stuck_after": timedelta(seconds=30)},
            ["new_pending", "lost", "old_pending"],
        ),
        ({"agent_slug": "alpha", "statuses": ["running", "completed"]}, ["live", "done_a"]),
        ({"agent_slug": "beta", "stuck": True}, ["lost"]),
        ({"worker": "host-1", "statuses": ["running"], "uid": "user"}, ["live"]),
        ({"agent_slug": "alpha", "uid": "u1", "worker": "host-10"}, ["done_a"]),
    ],
)
def test_list_runs_filters_and_their_combinations(
    repo: AgentRunRepository,
    listed: dict[str, AgentRun],
    t0: datetime,
    filters: dict[str, Any],
    expected: list[str],
) -> None:
    assert ids(repo.list_runs(now=t0, **filters)) == [listed[k].id for k in expected]


def test_list_runs_since_a_timestamp(
    repo: AgentRunRepository, listed: dict[str, AgentRun], t0: datetime
) -> None:
    since = listed["lost"].created_at.astimezone(UTC)
    got = repo.list_runs(since=since, now=t0)
    assert ids(got) == [listed[k].id for k in ("new_pending", "live", "lost")]


def test_keyset_pages_are_stable_under_concurrent_inserts(
    repo: AgentRunRepository, make_run: MakeRun, dsn: str, t0: datetime
) -> None:
    # Ties on created_at are broken by id.
    same = t0 - timedelta(hours=1)
    made = [make_run(created_at=same - timedelta(seconds=i // 3)) for i in range(20)]
    expected = [r.id for r in sorted(made, key=lambda r: (r.created_at, r.id), reverse=True)]
    stop = threading.Event()

    def insert_newer() -> None:
        with agent_runs.connect(dsn) as other:
            other_repo = AgentRunRepository(other)
            while not stop.is_set():
                key = uuid.uuid4().hex
                other_repo.create_run(thread_id=key, agent_slug="a", uid="u", request_id=key)

    inserter = threading.Thread(target=insert_newer)
    inserter.start()
    try:
        first = repo.list_runs(limit=7, since=same - timedelta(minutes=1))
        seen = ids(first)
        cursor = runs_cursor(first[-1])
        while True:
            page = repo.list_runs(limit=7, before=cursor)
            seen.extend(ids(page))
            if len(page) < 7:
                break
            cursor = runs_cursor(page[-1])
    finally:
        stop.set()
        inserter.join()
    first_ids = [i for i in seen if i in set(expected)]
    assert first_ids == expected  # every old run once, in order, none skipped
    assert len(seen) == len(set(seen))


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"statuses": "pending"}, "statuses"),
        ({"statuses": []}, "statuses"),
        ({"statuses": ["nope"]}, "statuses"),
        ({"limit": 0}, "limit"),
        ({"limit": 1001}, "limit"),
        ({"limit": True}, "limit"),
        ({"since": datetime(2030, 1, 1)}, "since"),
        ({"since": "2h"}, "since"),
        ({"stuck_after": 5}, "stuck_after"),
        ({"before": "not a cursor"}, "before"),
        ({"worker": ""}, "worker"),
        ({"agent_slug": "x" * 65}, "agent_slug"),
        ({"uid": "a\x00b"}, "uid"),
        ({"now": datetime(2030, 1, 1)}, "now"),
    ],
)
def test_list_runs_refuses_bad_arguments_by_name(
    repo: AgentRunRepository, kwargs: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidArgument, match=named):
        repo.list_runs(**kwargs)


# -- request_cancel_tree -------------------------------------------------------------------------


def test_cancel_tree_reaches_below_terminal_children_and_only_reports_changes(
    repo: AgentRunRepository, make_run: MakeRun, t0: datetime
) -> None:
    root = make_run(
        status="running",
        worker_id="w:1",
        heartbeat_at=t0,
        lease_expires_at=t0 + timedelta(minutes=1),
        started_at=t0,
    )
    child_done = done(make_run, t0, created_by_run_id=root.id)
    grandchild = make_run(created_by_run_id=child_done.id)  # pending, never started
    child_pending = make_run(created_by_run_id=root.id)
    unrelated = make_run()

    changed = repo.request_cancel_tree(root.id, now=t0)
    by_id = {run.id: run.status for run in changed}
    assert by_id == {
        root.id: RunStatus.CANCEL_REQUESTED,
        grandchild.id: RunStatus.CANCELLED,
        child_pending.id: RunStatus.CANCELLED,
    }
    assert changed[0].id == root.id
    still = repo.get_run(unrelated.id)
    assert still is not None and still.status == RunStatus.PENDING
    done_now = repo.get_run(child_done.id)
    assert done_now is not None and done_now.status == RunStatus.COMPLETED
    assert repo.request_cancel_tree(root.id, now=t0) == []


def test_cancel_tree_of_an_unknown_run_is_refused(repo: AgentRunRepository) -> None:
    with pytest.raises(InvalidArgument, match="run_id"):
        repo.request_cancel_tree("no-such-run")


def test_cancel_tree_under_concurrent_claims_and_completions(
    repo: AgentRunRepository, make_run: MakeRun, dsn: str, observer: Conn
) -> None:
    """Workers claim and complete tree members while the tree is cancelled: every run ends in a
    state the rules allow, and no run is left pending or running un-cancelled."""
    root = make_run(agent_slug="tree")
    members = [root]
    for i in range(30):
        members.append(make_run(agent_slug="tree", created_by_run_id=members[i // 3].id))
    start = threading.Barrier(4)
    cancelled: list[AgentRun] = []
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            with agent_runs.connect(dsn) as own:
                w = AgentRunRepository(own)
                start.wait()
                for _ in range(10):
                    run = w.claim_next(
                        worker_id=f"w{n}:{uuid.uuid4().hex}", lease_seconds=30, agent_slugs=["tree"]
                    )
                    if run is None:
                        return
                    status = "cancelled" if run.status == "cancel_requested" else "completed"
                    result = w.set_terminal_status(run.id, status=status, worker_id=run.worker_id)
                    if not result.changed:  # cancel requested in between: finish it cancelled
                        w.set_terminal_status(run.id, status="cancelled", worker_id=run.worker_id)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def canceller() -> None:
        try:
            with agent_runs.connect(dsn) as own:
                start.wait()
                cancelled.extend(AgentRunRepository(own).request_cancel_tree(root.id))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(3)]
    threads.append(threading.Thread(target=canceller))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors
    statuses = dict(
        observer.execute(
            "SELECT id, status FROM agent_runs WHERE id = ANY(%s)", ([m.id for m in members],)
        ).fetchall()
    )
    assert set(statuses.values()) <= {"completed", "cancelled", "cancel_requested"}
    for run in cancelled:  # what the call reported, it did change
        assert run.status in (RunStatus.CANCELLED, RunStatus.CANCEL_REQUESTED)
    assert len({run.id for run in cancelled}) == len(cancelled)
    assert repo.request_cancel_tree(root.id) == []  # nothing left that a request changes


# -- run_stats -----------------------------------------------------------------------------------


def test_run_stats_counts_the_window_and_the_queue(
    repo: AgentRunRepository, make_run: MakeRun, make_attempt: MakeAttempt, t0: datetime
) -> None:
    recent = t0 - timedelta(minutes=10)
    old = t0 - timedelta(days=3)
    a = done(make_run, recent)
    b = done(make_run, recent, status="failed", error_type="boom")
    done(make_run, old)  # outside the window
    make_attempt(
        a.id,
        worker_id="flaky:1",
        started_at=recent,
        finished_at=recent + timedelta(seconds=5),
        outcome="lease_expired",
        error_type="worker_lease_expired",
    )
    make_attempt(
        a.id,
        worker_id="steady:2",
        started_at=recent,
        finished_at=recent + timedelta(seconds=1),
        outcome="completed",
    )
    make_attempt(
        b.id,
        worker_id="flaky:3",
        started_at=recent,
        finished_at=recent + timedelta(seconds=3),
        outcome="failed",
        error_type="boom",
    )
    make_run(created_at=t0 - timedelta(minutes=20))  # pending
    make_run(
        status="running",
        worker_id="gone:9",
        heartbeat_at=t0 - timedelta(minutes=2),
        lease_expires_at=t0 - timedelta(minutes=1),
        started_at=t0 - timedelta(minutes=2),
    )

    stats = repo.run_stats(since=timedelta(hours=1), now=t0)
    assert stats.window_start == t0 - timedelta(hours=1)
    assert dict(stats.runs_by_status) == {"completed": 1, "failed": 1}
    assert dict(stats.attempts_by_outcome) == {"completed": 1, "failed": 1, "lease_expired": 1}
    assert dict(stats.top_error_types) == {"boom": 1, "worker_lease_expired": 1}
    assert [(w.worker, w.attempts, w.failures, w.lease_losses) for w in stats.workers] == [
        ("flaky", 2, 1, 1),
        ("steady", 1, 0, 0),
    ]
    assert stats.durations is not None
    assert (stats.durations.p50, stats.durations.max) == (3.0, 5.0)
    assert stats.queue.pending == 1 and stats.queue.running == 1
    assert stats.queue.expired_unreconciled == 1
    assert stats.queue.oldest_pending_age == timedelta(minutes=20)

    everything = repo.run_stats(now=t0)
    assert everything.window_start is None
    assert everything.runs_by_status["completed"] == 2


# -- prune_finished_runs -------------------------------------------------------------------------


def count(observer: Conn, table: str, ids_: list[str]) -> int:
    column = "id" if table == "agent_runs" else "run_id"
    row = observer.execute(
        f"SELECT count(*) FROM {table} WHERE {column} = ANY(%s)",  # noqa: S608 - fixed names
        (ids_,),
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_prune_deletes_old_trees_with_their_attempts_and_keeps_the_rest(
    repo: AgentRunRepository,
    make_run: MakeRun,
    make_attempt: MakeAttempt,
    observer: Conn,
    t0: datetime,
) -> None:
    old = t0 - timedelta(days=10)
    gone = [done(make_run, old + timedelta(seconds=i)) for i in range(7)]
    for run in gone:
        make_attempt(run.id, started_at=old, finished_at=old, outcome="completed")
    # A whole old tree goes together.
    tree_root = done(make_run, old)
    tree_child = done(make_run, old, created_by_run_id=tree_root.id)
    # Old parent, recent child: the tree waits. Old parent, live child: the tree waits.
    waits_root = done(make_run, old)
    waits_child = done(make_run, t0 - timedelta(minutes=5), created_by_run_id=waits_root.id)
    live_root = done(make_run, old)
    live_child = make_run(created_by_run_id=live_root.id)
    old_leaf_of_live = done(make_run, old, created_by_run_id=live_child.id)
    # Old but never terminal; recent terminal.
    pending_old = make_run(created_at=old)
    recent = done(make_run, t0 - timedelta(minutes=5))

    assert repo.prune_finished_runs(older_than=timedelta(days=1), batch_size=3, now=t0) == 9
    assert count(observer, "agent_runs", [*ids(gone), tree_root.id, tree_child.id]) == 0
    assert count(observer, "agent_run_attempts", ids(gone)) == 0
    kept = [waits_root, waits_child, live_root, live_child, old_leaf_of_live, pending_old, recent]
    assert count(observer, "agent_runs", ids(kept)) == len(kept)
    child = repo.get_run(waits_child.id)
    assert child is not None and child.created_by_run_id == waits_root.id  # lineage intact
    assert repo.prune_finished_runs(older_than=timedelta(days=1), now=t0) == 0


def test_prune_never_deletes_a_tree_that_gained_a_child_its_first_step_did_not_see(
    make_run: MakeRun, observer: Conn, t0: datetime
) -> None:
    """A child committed after the batch's first statement took its snapshot but before it
    locked the root: the second statement (a new snapshot) sees it and spares the tree."""
    root = done(make_run, t0 - timedelta(days=10))
    child = make_run(created_by_run_id=root.id)  # live, and unknown to step 1's list
    with observer.transaction():
        row = observer.execute(
            agent_runs.sql.query("prune_finished_runs.delete"),
            {"ids": [root.id], "roots": [root.id], "dry_run": False},
        ).fetchone()
    assert row is not None and (row[0], row[2]) == (0, 0)
    assert count(observer, "agent_runs", [root.id, child.id]) == 2
    kept = observer.execute(
        "SELECT created_by_run_id FROM agent_runs WHERE id = %s", [child.id]
    ).fetchone()
    assert kept == (root.id,)


def test_prune_dry_run_counts_without_deleting(
    repo: AgentRunRepository,
    make_run: MakeRun,
    make_attempt: MakeAttempt,
    observer: Conn,
    t0: datetime,
) -> None:
    old = t0 - timedelta(days=3)
    runs = [done(make_run, old) for _ in range(5)]
    for run in runs:
        make_attempt(run.id, started_at=old, finished_at=old, outcome="completed")
    batches = list(
        repo.prune_batches(older_than=timedelta(days=1), batch_size=2, now=t0, dry_run=True)
    )
    assert [b.runs for b in batches] == [2, 2, 1]
    assert sum(b.attempts for b in batches) == 5
    assert count(observer, "agent_runs", ids(runs)) == 5


def test_prune_skips_rows_someone_holds(
    repo: AgentRunRepository, make_run: MakeRun, dsn: str, observer: Conn, t0: datetime
) -> None:
    old = t0 - timedelta(days=3)
    held = done(make_run, old)
    free = done(make_run, old + timedelta(seconds=1))
    root = done(make_run, old + timedelta(seconds=2))
    held_child = done(make_run, old, created_by_run_id=root.id)
    with psycopg.connect(dsn) as holder:  # a transaction holding two rows
        holder.execute(
            "SELECT 1 FROM agent_runs WHERE id = ANY(%s) FOR UPDATE", ([held.id, held_child.id],)
        )
        assert repo.prune_finished_runs(older_than=timedelta(days=1), now=t0) == 1
        holder.rollback()
    assert count(observer, "agent_runs", [free.id]) == 0
    assert count(observer, "agent_runs", [held.id, root.id, held_child.id]) == 3
    assert repo.prune_finished_runs(older_than=timedelta(days=1), now=t0) == 3


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"older_than": timedelta(days=1), "batch_size": 0}, "batch_size"),
        ({"older_than": 3600}, "older_than"),
        ({"older_than": timedelta(days=-1)}, "older_than"),
        ({"older_than": timedelta(days=1), "now": datetime(2030, 1, 1)}, "now"),
    ],
)
def test_prune_refuses_bad_arguments_by_name(
    repo: AgentRunRepository, kwargs: dict[str, Any], named: str
) -> None:
    with pytest.raises(InvalidArgument, match=named):
        repo.prune_finished_runs(**kwargs)
