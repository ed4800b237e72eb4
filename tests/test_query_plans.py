"""The hot statements' plans on a seeded table: claims read the backlog in index order, and
every transition finds its run and its attempt by an index lookup, never by a walk.

The repository runs each statement as a server-side prepared statement, which PostgreSQL plans
generically after a few executions, so both plans are checked: the custom one (parameters
known) and the generic one (plan_cache_mode = force_generic_plan).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, Final, LiteralString

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb

import agent_runs
from agent_runs import AgentRunRepository
from agent_runs.repository import LEASE_EXPIRED_MESSAGE
from agent_runs.sql import query
from agent_runs.transport import statement

Conn = psycopg.Connection[Any]
Node = dict[str, Any]

PLAN_MODES: Final = ("force_custom_plan", "force_generic_plan")

# History and a backlog, vacuumed and analyzed while no run is live; then a burst of claims that
# the statistics have not seen yet (autovacuum catches up later). Estimates then make the partial
# indexes of live runs and open attempts look nearly empty, the case where a plan that walks
# them looks as cheap as a lookup.
_SEED: Final = """
WITH history AS (
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, started_at,
                            finished_at, created_at)
    SELECT 'done-' || i, 'done-req-' || i, 'thread-' || i, 'agent-' || mod(i, 4), 'user',
           'completed', now() - interval '2 days', now() - interval '1 day',
           now() - interval '3 days' + i * interval '1 second'
    FROM generate_series(1, 6000) AS i
    RETURNING id, started_at, finished_at
)
INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, finished_at, outcome)
SELECT id, 1, 'old-worker', started_at, finished_at, 'completed' FROM history;

INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, created_at)
SELECT 'pending-' || i, 'pending-req-' || i, 'pending-thread-' || i, 'agent-' || mod(i, 4),
       'user', now() - interval '1 hour' + i * interval '1 millisecond'
FROM generate_series(1, 3000) AS i;
"""

_LIVE: Final = """
WITH live AS (
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, worker_id,
                            heartbeat_at, lease_expires_at, started_at)
    SELECT 'live-' || i, 'live-req-' || i, 'live-thread-' || i, 'agent-0', 'user', 'running',
           'worker-' || i, now(), now() + interval '1 minute', now()
    FROM generate_series(%s::int, %s::int) AS i
    RETURNING id, worker_id, heartbeat_at, lease_expires_at, started_at
)
INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, heartbeat_at,
                                lease_expires_at)
SELECT id, 1, worker_id, started_at, heartbeat_at, lease_expires_at FROM live
"""


# A quiet system: only history when the statistics were taken; then a burst the statistics
# have not seen. Every partial index over active runs then looks empty to the planner, so a
# walk of one of them looks as cheap as a lookup by id, however many runs the burst brought.
_BURST: Final = """
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, created_at)
SELECT 'burst-' || i, 'burst-req-' || i, 'burst-thread-' || i, 'agent-' || mod(i, 4),
       'user', now() - interval '1 hour' + i * interval '1 millisecond'
FROM generate_series(1, 3000) AS i;
"""


@pytest.fixture(params=["backlog seen by the statistics", "burst after a quiet analyze"])
def seeded(request: pytest.FixtureRequest, dsn: str) -> Iterator[Conn]:
    """History (and a backlog, or not), vacuumed and analyzed; then what the statistics miss:
    400 live runs, and in the quiet case a backlog of 3000 too."""
    quiet = request.param == "burst after a quiet analyze"
    with agent_runs.connect(dsn) as conn:
        conn.execute(_SEED)
        if quiet:
            conn.execute("DELETE FROM agent_runs WHERE status = 'pending'")
        conn.execute("VACUUM (ANALYZE) agent_runs")
        conn.execute("VACUUM (ANALYZE) agent_run_attempts")
        if quiet:
            conn.execute(_BURST)
        conn.execute(_LIVE, (1, 400))
        yield conn


def _plan(conn: Conn, name: str, params: Mapping[str, Any], mode: str) -> Node:
    """EXPLAIN the statement the repository prepares for sql/<name>.sql, as it would run."""
    stmt = statement(name)
    args = [params[param] for param in stmt.params]
    placeholders = ", ".join(["%s"] * len(args))
    with conn.transaction(force_rollback=True):
        conn.execute(f"SET LOCAL plan_cache_mode = {mode}")
        conn.execute(stmt.prepare)
        try:
            cur = psycopg.ClientCursor(conn)
            row = cur.execute(
                f"EXPLAIN (FORMAT JSON) EXECUTE {stmt.name}({placeholders})",
                args,
            ).fetchone()
        finally:
            conn.execute(f"DEALLOCATE {stmt.name}")
    assert row is not None
    document = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    plan: Node = document[0]["Plan"]
    return plan


def _nodes(plan: Node) -> Iterator[Node]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


def _scans_of(plan: Node, relation: str) -> list[Node]:
    return [
        n for n in _nodes(plan) if n.get("Relation Name") == relation and "Scan" in n["Node Type"]
    ]


def _describe(plan: Node) -> str:
    return "\n".join(
        f"{n['Node Type']} {n.get('Relation Name', '')} {n.get('Index Name', '')} "
        f"{n.get('Index Cond', '')}"
        for n in _nodes(plan)
    )


def _claim_params(agent_slugs: list[str] | None) -> dict[str, Any]:
    return {
        "now": None,
        "agent_slugs": agent_slugs,
        "worker_id": "claimer",
        "lease_seconds": 30.0,
        "lost_message": LEASE_EXPIRED_MESSAGE,
    }


@pytest.mark.parametrize("mode", PLAN_MODES)
@pytest.mark.parametrize("agent_slugs", [None, ["agent-1"]], ids=["any-agent", "one-agent"])
def test_claim_next_reads_the_claimable_index_in_order_and_never_sorts(
    seeded: Conn, mode: str, agent_slugs: list[str] | None
) -> None:
    plan = _plan(seeded, "claim_next", _claim_params(agent_slugs), mode)
    kinds = {node["Node Type"] for node in _nodes(plan)}
    assert not kinds & {"Sort", "Incremental Sort"}, _describe(plan)
    used = {node.get("Index Name") for node in _nodes(plan)}
    assert "ix_agent_runs_claimable" in used, _describe(plan)
    assert all(n["Node Type"] != "Seq Scan" for n in _scans_of(plan, "agent_runs")), _describe(plan)


def _assert_lookups(plan: Node, relation: str, column: str) -> None:
    """Every scan of `relation` is an index scan (or a bitmap heap scan over one) with an
    equality condition on `column`."""
    scans = _scans_of(plan, relation)
    assert scans, _describe(plan)
    condition = re.compile(rf"(?<![\w.]){column} = ")
    for scan in scans:
        if scan["Node Type"] == "Bitmap Heap Scan":
            assert condition.search(scan.get("Recheck Cond", "")), _describe(plan)
            continue
        assert "Index" in scan["Node Type"], _describe(plan)
        assert condition.search(scan.get("Index Cond", "")), _describe(plan)


def _by_id(scan: Node) -> bool:
    """A lookup of runs by id (not a read of the backlog, which goes by priority)."""
    return bool(re.search(r"(?<![\w.])id = ", scan.get("Index Cond", "")))


def _running(seeded: Conn) -> tuple[str, str]:
    row = seeded.execute("SELECT id, worker_id FROM agent_runs WHERE id = 'live-7'").fetchone()
    assert row is not None
    return str(row[0]), str(row[1])


@pytest.mark.parametrize("mode", PLAN_MODES)
def test_claim_next_finds_the_claimed_runs_open_attempt_by_run_id(seeded: Conn, mode: str) -> None:
    """Converging a stale open attempt looks it up; it never walks every open attempt."""
    plan = _plan(seeded, "claim_next", _claim_params(None), mode)
    _assert_lookups(plan, "agent_run_attempts", "run_id")


@pytest.mark.parametrize("mode", PLAN_MODES)
@pytest.mark.parametrize("name", ["renew_lease", "set_terminal_status", "release_lease_for_retry"])
def test_a_transition_looks_up_its_run_and_its_attempt(seeded: Conn, mode: str, name: str) -> None:
    """By id and by run_id: a heartbeat's cost does not grow with the number of live runs."""
    run_id, worker_id = _running(seeded)
    params: dict[str, Any] = {
        "run_id": run_id,
        "worker_id": worker_id,
        "lease_seconds": 30.0,
        "now": None,
        "status": "completed",
        "error_type": None,
        "error_message": None,
        "output": None,
        "retry_after_seconds": None,
    }
    plan = _plan(seeded, name, params, mode)
    _assert_lookups(plan, "agent_runs", "id")
    _assert_lookups(plan, "agent_run_attempts", "run_id")


def _live_leases(seeded: Conn) -> tuple[list[str], list[str]]:
    """Ten live runs of the seeded backlog and their owners: a batch for renew or finish."""
    rows = seeded.execute(
        "SELECT id, worker_id FROM agent_runs WHERE id LIKE 'live-%' ORDER BY id LIMIT 10"
    ).fetchall()
    return [str(r[0]) for r in rows], [str(r[1]) for r in rows]


@pytest.mark.parametrize("mode", PLAN_MODES)
def test_renew_leases_looks_up_each_run_and_attempt_of_the_batch(seeded: Conn, mode: str) -> None:
    run_ids, worker_ids = _live_leases(seeded)
    params = {
        "run_ids": run_ids,
        "worker_ids": worker_ids,
        "lease_seconds": 30.0,
        "now": None,
    }
    plan = _plan(seeded, "renew_leases", params, mode)
    _assert_lookups(plan, "agent_runs", "id")
    _assert_lookups(plan, "agent_run_attempts", "run_id")
    # Deadlock-free whatever the plan: the runs are locked in id order, as they leave a sort
    # by id or a forward scan of the primary key.
    [lock] = [n for n in _nodes(plan) if n["Node Type"] == "LockRows"]
    [locked_from] = [n for n in lock["Plans"] if n["Parent Relationship"] == "Outer"]
    assert (locked_from["Node Type"], locked_from.get("Sort Key")) == ("Sort", ["r.id"]) or (
        locked_from["Node Type"],
        locked_from.get("Index Name"),
        locked_from.get("Scan Direction"),
    ) == ("Index Scan", "agent_runs_pkey", "Forward"), _describe(plan)


@pytest.mark.parametrize("mode", PLAN_MODES)
@pytest.mark.parametrize("agent_slugs", [None, ["agent-1"]], ids=["any-agent", "one-agent"])
def test_a_batched_claim_reads_the_claimable_index_in_order_and_looks_up_attempts(
    seeded: Conn, mode: str, agent_slugs: list[str] | None
) -> None:
    params = {**_claim_params(agent_slugs), "worker_ids": [f"claimer-{n}" for n in range(16)]}
    plan = _plan(seeded, "claim_next_attempts", params, mode)
    backlog_reads = [n for n in _scans_of(plan, "agent_runs") if not _by_id(n)]
    indexes = [n.get("Index Name") for n in backlog_reads]
    assert indexes == ["ix_agent_runs_claimable"], _describe(plan)
    sorts = [n for n in _nodes(plan) if n["Node Type"] in {"Sort", "Incremental Sort"}]
    # Only the claimed rows are numbered (at most one per worker_id, looked up by id); the
    # backlog is not sorted.
    sorted_walks = [
        scan for n in sorts for scan in _scans_of(n, "agent_runs") if "Index Cond" not in scan
    ]
    assert not sorted_walks, _describe(plan)
    _assert_lookups(plan, "agent_run_attempts", "run_id")


@pytest.mark.parametrize("mode", PLAN_MODES)
def test_finish_runs_looks_up_each_run_and_attempt_of_the_batch(seeded: Conn, mode: str) -> None:
    run_ids, worker_ids = _live_leases(seeded)
    params = {
        "run_ids": run_ids,
        "worker_ids": worker_ids,
        "statuses": ["completed"] * len(run_ids),
        "error_types": [None] * len(run_ids),
        "error_messages": [None] * len(run_ids),
        "outputs": [None] * len(run_ids),
        "now": None,
    }
    plan = _plan(seeded, "finish_runs", params, mode)
    _assert_lookups(plan, "agent_runs", "id")
    _assert_lookups(plan, "agent_run_attempts", "run_id")


@pytest.mark.parametrize("mode", PLAN_MODES)
def test_finish_runs_and_claim_looks_up_the_batch_and_reads_the_claimable_index_in_order(
    seeded: Conn, mode: str
) -> None:
    run_ids, worker_ids = _live_leases(seeded)
    params = {
        **_claim_params(None),
        "run_ids": run_ids,
        "finish_worker_ids": worker_ids,
        "statuses": ["completed"] * len(run_ids),
        "error_types": [None] * len(run_ids),
        "error_messages": [None] * len(run_ids),
        "outputs": [None] * len(run_ids),
        "worker_ids": [f"claimer-{n}" for n in range(len(run_ids))],
    }
    plan = _plan(seeded, "finish_runs_and_claim", params, mode)
    scans = _scans_of(plan, "agent_runs")
    backlog_reads = [n for n in scans if not _by_id(n)]
    assert [n.get("Index Name") for n in backlog_reads] == ["ix_agent_runs_claimable"], _describe(
        plan
    )
    for scan in scans:  # every other read of a run is a lookup by id
        if scan not in backlog_reads:
            assert re.search(r"(?<![\w.])id = ", scan["Index Cond"]), _describe(plan)
    _assert_lookups(plan, "agent_run_attempts", "run_id")


@pytest.mark.parametrize("traced", [False, True], ids=["telemetry off", "telemetry on"])
@pytest.mark.parametrize("mode", PLAN_MODES)
def test_create_runs_looks_up_each_request_id_of_the_batch(
    seeded: Conn, mode: str, traced: bool
) -> None:
    count = 10
    context = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    params = {
        "run_ids": [f"new-{i}" for i in range(count)],
        "request_ids": ["done-req-1", *(f"new-req-{i}" for i in range(1, count))],
        "thread_ids": [f"new-thread-{i}" for i in range(count)],
        "agent_slugs": ["agent-0"] * count,
        "uids": ["user"] * count,
        "run_types": ["chat"] * count,
        "created_by_run_ids": [None] * count,
        "concurrency_keys": [None] * count,
        "input_payloads": Jsonb([{}] * count),
        "trace_contexts": Jsonb([context] * count) if traced else None,
        "priorities": [0] * count,
        "available_ats": [None] * count,
    }
    plan = _plan(seeded, "create_runs", params, mode)
    _assert_lookups(plan, "agent_runs", "request_id")


@pytest.mark.parametrize("mode", PLAN_MODES)
def test_the_reconciler_never_reads_the_history(seeded: Conn, mode: str, t0: datetime) -> None:
    """It reads the live runs (ix_agent_runs_live) when the statistics know the backlog. After a
    quiet ANALYZE both partial indexes over active runs look empty, and the planner may read
    the wider one (live and pending runs): still never the finished history."""
    plan = _plan(seeded, "reconcile_expired_leases.lock", {"now": t0, "limit": 500}, mode)
    assert all(n["Node Type"] != "Seq Scan" for n in _scans_of(plan, "agent_runs")), _describe(plan)
    used = {node.get("Index Name") for node in _nodes(plan)}
    assert used & {"ix_agent_runs_live", "uq_agent_runs_one_active_per_thread"}, _describe(plan)


@pytest.mark.parametrize("mode", PLAN_MODES)
def test_the_reconciler_reads_only_live_runs_when_the_backlog_is_known(
    dsn: str, mode: str, t0: datetime
) -> None:
    with agent_runs.connect(dsn) as conn:
        conn.execute(_SEED)
        conn.execute("VACUUM (ANALYZE) agent_runs")
        conn.execute(_LIVE, (1, 400))
        plan = _plan(conn, "reconcile_expired_leases.lock", {"now": t0, "limit": 500}, mode)
    used = {node.get("Index Name") for node in _nodes(plan)}
    assert "ix_agent_runs_live" in used, _describe(plan)


# Retried history: runs of many attempts each, so that the statistics expect dozens of attempts
# per run. Reading max(finished_at) backward off ix_agent_run_attempts_finished, filtered by
# run_id, then looks as cheap as a lookup, and walks every finished attempt for a new run.
_RETRIED_HISTORY: Final = """
WITH history AS (
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, started_at,
                            finished_at, created_at)
    SELECT 'done-' || i, 'done-req-' || i, 'thread-' || i, 'agent-0', 'user', 'completed',
           now() - interval '2 days', now() - interval '1 day', now() - interval '3 days'
    FROM generate_series(1, 200) AS i
    RETURNING id, started_at
)
INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, finished_at, outcome)
SELECT id, n, 'old-worker', started_at + n * interval '1 minute',
       started_at + n * interval '1 minute' + interval '30 seconds',
       CASE WHEN n = 30 THEN 'completed' ELSE 'retry_released' END
FROM history, generate_series(1, 30) AS n;

INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, created_at)
SELECT 'pending-' || i, 'pending-req-' || i, 'pending-thread-' || i, 'agent-0', 'user',
       now() - interval '1 hour' + i * interval '1 millisecond'
FROM generate_series(1, 100) AS i;
"""


@pytest.mark.parametrize("mode", PLAN_MODES)
@pytest.mark.parametrize("name", ["claim_next", "claim_next_attempts", "mark_running"])
def test_a_claim_reads_only_its_own_runs_attempts_after_a_retried_history(
    dsn: str, mode: str, name: str
) -> None:
    """The next attempt_no and the last end come from the claimed run's own attempts, however
    many attempts the history holds and however many per run the statistics expect."""
    params = {
        **_claim_params(None),
        "worker_ids": [f"claimer-{n}" for n in range(16)],
        "run_id": "pending-1",
    }
    with agent_runs.connect(dsn) as conn:
        conn.execute(_RETRIED_HISTORY)
        conn.execute("VACUUM (ANALYZE) agent_runs")
        conn.execute("VACUUM (ANALYZE) agent_run_attempts")
        plan = _plan(conn, name, params, mode)
    _assert_lookups(plan, "agent_run_attempts", "run_id")


# --- plans over a realistic table: history, backlog, live and lost leases ---------------------


# Values for the named parameters of the hot queries, by name, for EXPLAIN.
def _params(name: str, values: dict[str, Any]) -> dict[str, Any]:
    wanted = set(re.findall(r"%\((\w+)\)s", query(name)))
    missing = wanted - set(values)
    assert not missing, f"{name}.sql takes parameters this test has no value for: {missing}"
    return {key: values[key] for key in wanted}


def _plan_nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _plan_nodes(child)


def _explain(observer: Conn, statement: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    text = "EXPLAIN (FORMAT JSON)\n" + statement
    row = observer.execute(text, params).fetchone()
    assert row is not None
    return list(_plan_nodes(row[0][0]["Plan"]))


def _explain_generic(observer: Conn, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
    """The generic plan of the statement the repository prepares for sql/<name>.sql."""
    stmt = statement(name)
    with observer.transaction(force_rollback=True):
        observer.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        observer.execute(stmt.prepare)
        try:
            args = sql.SQL(", ").join(sql.Literal(params[param]) for param in stmt.params)
            row = observer.execute(
                sql.SQL("EXPLAIN (FORMAT JSON) EXECUTE {} ({})").format(
                    sql.Identifier(stmt.name), args
                )
            ).fetchone()
        finally:
            observer.execute(sql.SQL("DEALLOCATE {}").format(sql.Identifier(stmt.name)))
    assert row is not None
    return list(_plan_nodes(row[0][0]["Plan"]))


def _index_scans(nodes: list[dict[str, Any]]) -> set[str]:
    return {node["Index Name"] for node in nodes if "Index Name" in node}


def _seq_scanned(nodes: list[dict[str, Any]]) -> set[str]:
    return {node["Relation Name"] for node in nodes if node["Node Type"] == "Seq Scan"}


def _sorts(nodes: list[dict[str, Any]]) -> list[str]:
    return [node["Node Type"] for node in nodes if "Sort" in node["Node Type"]]


def _seed_table(observer: Conn, *, pending: int, finished: int, live: int, expired: int) -> None:
    """A realistic table: a long finished history, a backlog, a few live and lost leases."""
    counts = {"pending": pending, "finished": finished, "live": live, "expired": expired}
    for insert in _TABLE_SEED:
        observer.execute(insert, counts)
    observer.execute("ANALYZE agent_runs")
    observer.execute("ANALYZE agent_run_attempts")


_TABLE_SEED: list[LiteralString] = [
    """
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status,
                            created_at, started_at, finished_at)
    SELECT 'done-' || i, 'done-req-' || i, 'done-thread-' || i, 'agent-' || (i %% 7), 'u',
           'completed', now() - interval '30 days' + i * interval '1 second',
           now() - interval '30 days', now() - interval '29 days'
    FROM generate_series(1, %(finished)s) AS i
    """,
    """
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, created_at)
    SELECT 'todo-' || i, 'todo-req-' || i, 'todo-thread-' || i, 'agent-' || (i %% 7), 'u',
           now() - interval '1 day' + i * interval '1 second'
    FROM generate_series(1, %(pending)s) AS i
    """,
    """
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, worker_id,
                            heartbeat_at, lease_expires_at, started_at)
    SELECT 'live-' || i, 'live-req-' || i, 'live-thread-' || i, 'agent-1', 'u', 'running',
           'w-' || i, now(), now() + interval '1 hour', now()
    FROM generate_series(1, %(live)s) AS i
    """,
    """
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, worker_id,
                            heartbeat_at, lease_expires_at, started_at)
    SELECT 'lost-' || i, 'lost-req-' || i, 'lost-thread-' || i, 'agent-1', 'u', 'running',
           'w-lost-' || i, now() - interval '2 hours', now() - interval '1 hour',
           now() - interval '2 hours'
    FROM generate_series(1, %(expired)s) AS i
    """,
]


# The sql/ files each repository method runs.
_FILES_OF = {
    "claim_next": ["claim_next"],
    "reconcile_expired_leases": ["reconcile_expired_leases", "reconcile_expired_leases.lock"],
}


def _plans(observer: Conn, method: str, values: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """Custom and generic plans of every sql/ file the repository method uses."""
    names = _FILES_OF[method]
    plans = []
    for name in names:
        params = _params(name, values)
        plans.append(_explain(observer, query(name), params))
        plans.append(_explain_generic(observer, name, params))
    return plans


@pytest.mark.parametrize("agent_slugs", [None, ["agent-3"], ["agent-2", "agent-5"]])
def test_claim_next_reads_the_claimable_index_in_order_without_sorting(
    repo: AgentRunRepository, observer: Conn, agent_slugs: list[str] | None
) -> None:
    _seed_table(observer, pending=2000, finished=4000, live=20, expired=0)
    values = {
        "worker_id": "w",
        "lease_seconds": 30.0,
        "now": None,
        "agent_slugs": agent_slugs,
        "lost_message": "lost",
    }
    plans = _plans(observer, "claim_next", values)
    for plan in plans:
        assert not _sorts(plan), f"claim_next sorts: {_sorts(plan)}"
        assert "agent_runs" not in _seq_scanned(plan)
        assert "ix_agent_runs_claimable" in _index_scans(plan)
    # And the real call takes the oldest claimable run of those slugs from that backlog.
    oldest = observer.execute(
        "SELECT id FROM agent_runs WHERE status = 'pending'"
        " AND (%(slugs)s::text[] IS NULL OR agent_slug = ANY(%(slugs)s::text[]))"
        " ORDER BY created_at, id LIMIT 1",
        {"slugs": agent_slugs},
    ).fetchone()
    claimed = repo.claim_next(worker_id="w", lease_seconds=30, agent_slugs=agent_slugs)
    assert claimed is not None and oldest is not None and claimed.id == oldest[0]


def test_the_reconciler_finds_lost_leases_through_the_live_index(
    repo: AgentRunRepository, observer: Conn
) -> None:
    _seed_table(observer, pending=1000, finished=5000, live=30, expired=5)
    lost = [f"lost-{i}" for i in range(1, 6)]
    values = {"now": None, "limit": 500, "lost_message": "lost", "run_ids": lost}
    plans = _plans(observer, "reconcile_expired_leases", values)
    for plan in plans:
        assert "agent_runs" not in _seq_scanned(plan)
    assert any("ix_agent_runs_live" in _index_scans(plan) for plan in plans[::2])  # custom
    assert any("ix_agent_runs_live" in _index_scans(plan) for plan in plans[1::2])  # generic
    converged = repo.reconcile_expired_leases(now=datetime.now(UTC))
    assert sorted(run.id for run in converged) == lost
