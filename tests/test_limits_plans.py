"""Limits per key over the recovery policy's claim order: migration 0018 rebuilt the policy's
claim index (priority, available_at, id) with `AND NOT key_waiting`, and every statement that
walks it (the claims, next_available) still reads it, past 20,000 runs parked behind full keys,
without reading them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import psycopg
import pytest

from agent_runs.repository import LEASE_EXPIRED_MESSAGE
from tests.test_schedule_plans import _analyze, _nodes, seeded_clone

# Limits first, so the insert trigger parks every keyed run (a limit of 0: the key is full).
_SEED: Final = """
INSERT INTO agent_run_limits (concurrency_key, max_running)
SELECT 'full-' || k, 0 FROM generate_series(1, 1000) AS k;
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, priority, concurrency_key)
SELECT 'parked-' || i, 'parked-r-' || i, 'parked-t-' || i, 'agent', 'user', 0,
       'full-' || (1 + mod(i, 1000))
FROM generate_series(1, 20000) AS i;
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, priority, available_at)
SELECT 'later-' || i, 'later-r-' || i, 'later-t-' || i, 'agent', 'user', 3,
       now() + interval '1 hour'
FROM generate_series(1, 10) AS i;
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, priority)
SELECT 'free-' || i, 'free-r-' || i, 'free-t-' || i, 'agent', 'user', 5
FROM generate_series(1, 50) AS i;
"""


@pytest.fixture(scope="module")
def parked(_databases: Any) -> Iterator[psycopg.Connection[Any]]:
    yield from seeded_clone(_databases, _SEED)


def test_0018_rebuilt_the_policys_claim_index_with_its_key_columns(
    parked: psycopg.Connection[Any],
) -> None:
    row = parked.execute(
        "SELECT pg_get_indexdef(i.indexrelid), pg_get_expr(i.indpred, i.indrelid)"
        " FROM pg_index i WHERE i.indexrelid = 'ix_agent_runs_claimable'::regclass"
    ).fetchone()
    assert row is not None
    definition, predicate = row
    assert "(priority, available_at, id)" in definition, definition
    assert "pending" in predicate and "NOT key_waiting" in predicate, predicate
    counts = parked.execute(
        "SELECT count(*) FILTER (WHERE key_waiting), count(*) FROM agent_runs"
    ).fetchone()
    assert counts == (20000, 20060)


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize("name", ["claim_next", "claim_next_attempts", "next_available"])
def test_a_claim_walks_the_claim_index_past_parked_runs_without_reading_them(
    parked: psycopg.Connection[Any], mode: str, name: str
) -> None:
    params = {
        "now": None,
        "agent_slugs": None,
        "worker_id": "w",
        "worker_ids": ["w:1", "w:2"],
        "lease_seconds": 30.0,
        "lost_message": LEASE_EXPIRED_MESSAGE,
    }
    plan = _analyze(parked, name, params, mode)
    nodes = list(_nodes(plan))
    walks = [n for n in nodes if n.get("Index Name") == "ix_agent_runs_claimable"]
    assert walks, nodes
    for scan in walks:
        # ten probes (one per priority): never the 20,000 parked runs of priority 0
        assert scan["Shared Hit Blocks"] + scan["Shared Read Blocks"] <= 60, scan
        assert scan.get("Rows Removed by Filter", 0) == 0, scan
    assert not [n for n in nodes if n["Node Type"] == "Seq Scan"
                and n.get("Relation Name") == "agent_runs"]  # fmt: skip
    assert plan["Actual Rows"] >= 1, plan  # a free run claimed (or the scheduled one found)


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan"])
def test_the_scheduled_listing_reads_the_claim_index_and_the_parked_runs_index(
    parked: psycopg.Connection[Any], mode: str
) -> None:
    params = {"now": None, "agent_slug": None, "limit": 50}
    nodes = list(_nodes(_analyze(parked, "list_scheduled_runs", params, mode)))
    used = {n.get("Index Name") for n in nodes}
    assert {"ix_agent_runs_claimable", "ix_agent_runs_key_parked_available"} <= used, used
    assert not [n for n in nodes if n["Node Type"] == "Seq Scan"
                and n.get("Relation Name") == "agent_runs"]  # fmt: skip
