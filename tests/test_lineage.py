"""Lineage is a tree: a run is never its own parent or ancestor, whichever client writes it, and
migration 0009 cut the loops stored before it so that prune can remove them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from agent_runs import AgentRunRepository, InvalidArgument
from agent_runs.migrate import apply_migrations, rollback_migrations
from tests.helpers import everything, new_run
from tests.test_migrations import ALL as MIGRATIONS

Conn = psycopg.Connection[Any]


def test_a_run_cannot_be_its_own_parent(repo: AgentRunRepository, observer: Conn) -> None:
    before = everything(observer)
    with pytest.raises(InvalidArgument, match="created_by_run_id"):
        new_run(repo, run_id="loop", created_by_run_id="loop")
    assert everything(observer) == before


def test_the_schema_refuses_a_self_parent_and_a_loop_made_by_any_client(
    repo: AgentRunRepository, observer: Conn
) -> None:
    with pytest.raises(psycopg.errors.CheckViolation, match="ck_agent_runs_not_own_parent"):
        observer.execute(
            "INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid,"
            " created_by_run_id) VALUES ('x', 'rx', 't', 'a', 'u', 'x')"
        )
    root = new_run(repo)
    child = new_run(repo, created_by_run_id=root.id)
    grandchild = new_run(repo, created_by_run_id=child.id)
    with pytest.raises(psycopg.errors.CheckViolation, match="its own ancestor"):
        observer.execute(
            "UPDATE agent_runs SET created_by_run_id = %s WHERE id = %s", (grandchild.id, root.id)
        )
    # A re-parenting that keeps a tree is still allowed; so is cutting a link.
    other = new_run(repo)
    observer.execute(
        "UPDATE agent_runs SET created_by_run_id = %s WHERE id = %s", (other.id, root.id)
    )
    observer.execute("UPDATE agent_runs SET created_by_run_id = NULL WHERE id = %s", (root.id,))


def test_0009_cuts_the_loops_already_stored_and_prune_then_removes_them(blank_dsn: str) -> None:
    apply_migrations(blank_dsn)
    later = MIGRATIONS[MIGRATIONS.index("0009_lineage_is_a_tree") :]
    assert rollback_migrations(blank_dsn, count=len(later)) == later[::-1]
    old = datetime(2020, 1, 1, tzinfo=UTC)
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        for run_id, parent in (("self", "self"), ("a", None), ("b", "a"), ("below-self", "self")):
            conn.execute(
                "INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status,"
                " created_by_run_id, created_at, finished_at)"
                " VALUES (%s, %s, %s, 'a', 'u', 'completed', %s, %s, %s)",
                (run_id, f"r-{run_id}", f"t-{run_id}", parent, old, old),
            )
        conn.execute("UPDATE agent_runs SET created_by_run_id = 'b' WHERE id = 'a'")  # a <-> b
    apply_migrations(blank_dsn)
    with psycopg.connect(blank_dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT id, created_by_run_id FROM agent_runs").fetchall()
        parents: dict[str, str | None] = dict(rows)
        assert parents == {"self": None, "a": None, "b": "a", "below-self": "self"}
        pruned = AgentRunRepository(conn).prune_finished_runs(older_than=timedelta(days=1))
        assert pruned == 4
