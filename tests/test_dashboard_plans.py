"""The dashboard's own queries on a seeded history: each reads through an index (the operator
indexes of migrations 0004/0008, the partial indexes of live runs), never a whole table."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, Final

import psycopg
import pytest

from agent_runs.sql import query

Conn = psycopg.Connection[Any]

# 30 days of finished runs (two attempts for one in ten), a backlog, a few live runs, and a tree.
_SEED: Final = """
WITH history AS (
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, error_type,
                            started_at, finished_at, created_at)
    SELECT 'done-' || i, 'req-' || i, 'thread-' || mod(i, 97), 'agent-' || mod(i, 4), 'user',
           CASE WHEN mod(i, 10) = 0 THEN 'failed' ELSE 'completed' END,
           CASE WHEN mod(i, 10) = 0 THEN 'tool_error' END,
           now() - interval '30 days' + i * interval '1 minute' + interval '1 second',
           now() - interval '30 days' + i * interval '1 minute' + interval '20 seconds',
           now() - interval '30 days' + i * interval '1 minute'
    FROM generate_series(1, 40000) AS i
    RETURNING id, status, started_at, finished_at
)
INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, finished_at, outcome,
                                error_type)
SELECT id, 1, 'host-' || mod(length(id), 5) || ':' || md5(id), started_at, finished_at, status,
       CASE WHEN status = 'failed' THEN 'tool_error' END
FROM history;

INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, created_at)
SELECT 'pending-' || i, 'pending-req-' || i, 'pending-thread-' || i, 'agent-1', 'user',
       now() - interval '10 minutes' + i * interval '1 second'
FROM generate_series(1, 200) AS i;

WITH live AS (
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, worker_id,
                            heartbeat_at, lease_expires_at, started_at, created_by_run_id)
    SELECT 'live-' || i, 'live-req-' || i, 'live-thread-' || i, 'agent-0', 'user', 'running',
           'host-9:' || i, now(), now() + interval '1 minute', now(),
           CASE WHEN i > 1 THEN 'live-1' END
    FROM generate_series(1, 50) AS i
    RETURNING id, worker_id, heartbeat_at, lease_expires_at, started_at
)
INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, heartbeat_at,
                                lease_expires_at)
SELECT id, 1, worker_id, started_at, heartbeat_at, lease_expires_at FROM live;

ANALYZE agent_runs;
ANALYZE agent_run_attempts;
"""


@pytest.fixture(scope="module")
def seeded(_databases: Any) -> Iterator[Conn]:
    name = _databases.take_clone()
    try:
        with psycopg.connect(_databases.server.url_for(name), autocommit=True) as conn:
            conn.execute(_SEED)
            yield conn
    finally:
        _databases.drop(name)


def _plan(conn: Conn, name: str, params: dict[str, Any]) -> dict[str, Any]:
    row = conn.execute("EXPLAIN (FORMAT JSON)\n" + query(name), params).fetchone()
    assert row is not None
    document = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    plan: dict[str, Any] = document[0]["Plan"]
    return plan


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _scans(plan: dict[str, Any]) -> tuple[set[str], set[str]]:
    """(indexes read, tables read whole)."""
    indexes = {n["Index Name"] for n in _nodes(plan) if "Index Name" in n}
    seq = {n["Relation Name"] for n in _nodes(plan) if n["Node Type"] == "Seq Scan"}
    return indexes, seq


NOW = datetime.now(UTC)
CASES: Final[dict[str, tuple[dict[str, Any], set[str]]]] = {
    "dashboard.live": (
        {"now": None},
        {"uq_agent_runs_one_active_per_thread", "ix_agent_runs_live"},
    ),
    "dashboard.per_minute": ({"now": None}, {"ix_agent_runs_finished"}),
    "dashboard.agents": (
        {"window_start": NOW - timedelta(days=1), "top": 20},
        {"ix_agent_runs_finished"},
    ),
    "dashboard.workers": (
        {"window_start": NOW - timedelta(hours=1), "now": None, "top": 200},
        {"ix_agent_run_attempts_finished"},
    ),
    "run_stats.runs": ({"window_start": NOW - timedelta(days=1)}, {"ix_agent_runs_finished"}),
    "dashboard.children": ({"run_id": "live-1", "limit": 51}, {"ix_agent_runs_created_by_run_id"}),
    "dashboard.finished_runs": (
        {
            "window_start": NOW - timedelta(days=1),
            "before_at": None,
            "before_id": None,
            "statuses": None,
            "agent_slug": None,
            "thread_id": None,
            "uid": None,
            "error_type": "tool_error",
            "limit": 51,
        },
        {"ix_agent_runs_finished"},
    ),
    "dashboard.runs_by_attempt": (
        {
            "window_start": NOW - timedelta(hours=1),
            "before_at": None,
            "before_id": None,
            "outcomes": ["failed", "lease_expired"],
            "error_type": None,
            "worker": "host-1",
            "limit": 51,
        },
        {"ix_agent_run_attempts_finished", "agent_runs_pkey"},
    ),
    "dashboard.find_runs": ({"prefix": "done-12", "limit": 21}, {"agent_runs_pkey"}),
    "dashboard.run_times": ({"ids": ["done-1", "done-2"]}, {"agent_runs_pkey"}),
    "dashboard.tree": (
        {"run_id": "live-7", "limit": 51, "up": 100, "down": 100},
        {"agent_runs_pkey", "ix_agent_runs_created_by_run_id"},
    ),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_dashboard_query_reads_through_an_index(seeded: Conn, name: str) -> None:
    params, expected = CASES[name]
    indexes, seq = _scans(_plan(seeded, name, params))
    assert not seq & {"agent_runs", "agent_run_attempts"}, (name, seq, indexes)
    assert indexes & expected, (name, indexes)


def _list_params(statuses: list[str]) -> dict[str, Any]:
    return {
        "before_created_at": None,
        "before_id": None,
        "statuses": statuses,
        "agent_slug": None,
        "thread_id": None,
        "uid": None,
        "concurrency_key": None,
        "worker": None,
        "since_at": None,
        "since_seconds": None,
        "stuck": False,
        "stuck_after_seconds": 900.0,
        "limit": 50,
        "now": None,
        "documents": False,
    }


@pytest.mark.parametrize(
    "statuses",
    [
        ["failed"],
        ["completed", "cancelled"],
        ["pending"],
        ["running"],
        ["running", "cancel_requested"],
    ],
)
def test_runs_by_status_never_walk_the_half_that_cannot_hold_them(
    seeded: Conn, statuses: list[str]
) -> None:
    """The dashboard's /runs?status=...: list_runs reads settled runs and live runs as two
    halves; the half that cannot hold any status asked for is never executed (else its index
    walk, filtered by an impossible status, read all 1,000,000 runs in 300 ms in the bench)."""
    row = seeded.execute(
        "EXPLAIN (ANALYZE, FORMAT JSON, TIMING OFF)\n" + query("list_runs"), _list_params(statuses)
    ).fetchone()
    assert row is not None
    plan = (row[0] if not isinstance(row[0], str) else json.loads(row[0]))[0]["Plan"]
    executed = [
        n.get("Index Name", n["Node Type"])
        for n in _nodes(plan)
        if n.get("Relation Name") == "agent_runs" and n.get("Actual Loops", 0) > 0
    ]
    assert len(executed) == 1, executed  # one half read, the other never started


_LIVE_BY_EIGHT_WORKERS: Final = """
WITH live AS (
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, worker_id,
                            heartbeat_at, lease_expires_at, started_at, created_at)
    SELECT 'live-' || i, 'live-req-' || i, 'live-thread-' || i, 'agent', 'user', 'running',
           'host-' || mod(i, 8) || ':' || i, now(), now() + interval '5 minutes', now(),
           now() - interval '1 hour' + i * interval '1 second'
    FROM generate_series(1, 800) AS i
    RETURNING id, worker_id, heartbeat_at, lease_expires_at, started_at
)
INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, heartbeat_at,
                                lease_expires_at)
SELECT id, 1, worker_id, started_at, heartbeat_at, lease_expires_at FROM live;
ANALYZE agent_runs;
ANALYZE agent_run_attempts;
"""


def test_the_worker_filter_probes_live_runs_newest_first_and_stops(
    observer: Conn,
) -> None:
    """/runs?worker=NAME: live runs (read whole through ix_agent_runs_live, which has no order)
    are sorted first and probed for the worker's attempts newest first until the page is full,
    not every live run probed before the sort (10,000 probes: over the 50 ms target)."""
    observer.execute(_LIVE_BY_EIGHT_WORKERS)
    params = {**_list_params(["running"]), "worker": "host-3", "limit": 10}
    row = observer.execute(
        "EXPLAIN (ANALYZE, FORMAT JSON, TIMING OFF)\n" + query("list_runs"), params
    ).fetchone()
    assert row is not None
    plan = (row[0] if not isinstance(row[0], str) else json.loads(row[0]))[0]["Plan"]
    probes = sum(
        n.get("Actual Loops", 0)
        for n in _nodes(plan)
        if n.get("Relation Name") == "agent_run_attempts" and "worker" in str(n.get("Filter", ""))
    )
    # Ten matches among eight workers interleaved: about 80 probes, never all 800 live runs.
    assert 10 <= probes <= 120, probes
    page = observer.execute(query("list_runs"), params).fetchall()
    assert [r[0] for r in page] == [f"live-{i}" for i in range(795, 714, -8)][:10]
