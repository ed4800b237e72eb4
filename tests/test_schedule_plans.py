"""A claim never reads runs scheduled for later: with 100,000 of them over the lower priorities,
claim_next and claim_next_attempts read a handful of index pages and sort nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Final

import psycopg
import pytest

import agent_runs
from agent_runs.repository import LEASE_EXPIRED_MESSAGE
from agent_runs.transport import statement

_SEED: Final = """
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, priority, available_at)
SELECT 'later-' || i, 'later-r-' || i, 'later-t-' || i, 'agent', 'user', mod(i, 9),
       now() + interval '1 hour' + i * interval '1 millisecond'
FROM generate_series(1, 100000) AS i;
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, priority)
SELECT 'now-' || i, 'now-r-' || i, 'now-t-' || i, 'agent', 'user', 9
FROM generate_series(1, 50) AS i;
"""


def seeded_clone(databases: Any, seed: str) -> Iterator[psycopg.Connection[Any]]:
    """A clone of the migrated template, seeded by `seed` and analysed, for a module's plan
    tests (seeding once is enough); given back afterwards."""
    name = databases.take_clone()
    try:
        with agent_runs.connect(databases.server.url_for(name)) as conn:
            conn.execute(seed)
            conn.execute("VACUUM (ANALYZE) agent_runs")
            yield conn
    finally:
        databases.give_back(name)


@pytest.fixture(scope="module")
def scheduled(_databases: Any) -> Iterator[psycopg.Connection[Any]]:
    """One database for the module: seeding 100,000 runs once is enough."""
    yield from seeded_clone(_databases, _SEED)


def _analyze(conn: psycopg.Connection[Any], name: str, params: dict[str, Any], mode: str) -> Any:
    stmt = statement(name)
    args = [params[p] for p in stmt.params]
    placeholders = ", ".join(["%s"] * len(args))
    with conn.transaction(force_rollback=True):
        conn.execute(f"SET LOCAL plan_cache_mode = {mode}")
        conn.execute(stmt.prepare)
        try:
            row = (
                psycopg.ClientCursor(conn)
                .execute(
                    f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) EXECUTE {stmt.name}({placeholders})",
                    args,
                )
                .fetchone()
            )
        finally:
            conn.execute(f"DEALLOCATE {stmt.name}")
    assert row is not None
    document = row[0] if not isinstance(row[0], str) else json.loads(row[0])
    return document[0]["Plan"]


def _nodes(plan: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield plan
    for child in plan.get("Plans", []):
        yield from _nodes(child)


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize("name", ["claim_next", "claim_next_attempts"])
def test_a_claim_reads_no_run_scheduled_for_later(
    scheduled: psycopg.Connection[Any], mode: str, name: str
) -> None:
    params = {
        "now": None,
        "agent_slugs": None,
        "worker_id": "w",
        "worker_ids": ["w:1", "w:2"],
        "lease_seconds": 30.0,
        "lost_message": LEASE_EXPIRED_MESSAGE,
    }
    plan = _analyze(scheduled, name, params, mode)
    nodes = list(_nodes(plan))
    assert not [n for n in nodes if n["Node Type"] in {"Sort", "Incremental Sort"}
                and any(c.get("Relation Name") == "agent_runs" for c in _nodes(n))]  # fmt: skip
    backlog = [n for n in nodes if n.get("Index Name") == "ix_agent_runs_claimable"]
    assert backlog, plan
    for scan in backlog:
        pages = scan["Shared Hit Blocks"] + scan["Shared Read Blocks"]
        # ten probes (one per priority), each a descent of the index: never the 100,000 runs
        assert pages <= 60, (pages, scan)
        assert scan.get("Rows Removed by Filter", 0) == 0
    assert not [n for n in nodes if n["Node Type"] == "Seq Scan"
                and n.get("Relation Name") == "agent_runs"]  # fmt: skip
