"""The operator's reads stay small beside a long history: `run_stats` finds the oldest pending
run, and `list_runs(stuck=True)` its stuck pending runs, without walking the listing index of
finished runs (which holds pending runs too, in created_at order, among every finished one).

And what "stuck" means for a pending run: available to claim for longer than stuck_after (a run
scheduled for later, or backed off, is not stuck while it waits)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Final

import psycopg
import pytest

from agent_runs import AgentRunRepository
from agent_runs.repository import operator_queries
from agent_runs.steps import Execute
from tests.helpers import new_run
from tests.test_schedule_plans import _analyze, seeded_clone

# Finished runs created before and after 300 pending runs that have waited about two hours: a
# walk of the listing index from either end passes 30,000 finished runs before the pending ones
# (and with that many pending runs the planner estimates such a walk to be short).
_SEED: Final = """
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, status, started_at,
                        finished_at, created_at)
SELECT 'done-' || i, 'done-r-' || i, 'done-t-' || i, 'agent', 'user', 'completed',
       now() - interval '3 hours', now() - interval '3 hours',
       CASE WHEN i <= 30000 THEN now() - interval '3 days' + i * interval '1 second'
            ELSE now() - interval '1 hour' + i * interval '1 millisecond' END
FROM generate_series(1, 60000) AS i;
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, created_at)
SELECT 'waiting-' || i, 'waiting-r-' || i, 'waiting-t-' || i, 'agent', 'user',
       now() - interval '2 hours' + i * interval '1 second'
FROM generate_series(1, 300) AS i;
"""
_SETTLED_INDEX: Final = "ix_agent_runs_settled_created"


@pytest.fixture(scope="module")
def history(_databases: Any) -> Iterator[psycopg.Connection[Any]]:
    yield from seeded_clone(_databases, _SEED)


def _first_execute(plan: Any) -> Execute:
    step = next(plan)
    assert isinstance(step, Execute)
    return step


def _rows_read_from(node: dict[str, Any], index: str) -> int:
    """Index entries `index` gave over the plan: rows returned and rows its filter removed."""
    returned = node.get("Actual Rows", 0) * node.get("Actual Loops", 0)
    own = returned + node.get("Rows Removed by Filter", 0)
    read = own if node.get("Index Name") == index else 0
    return read + sum(_rows_read_from(child, index) for child in node.get("Plans", []))


@pytest.mark.parametrize("mode", ["force_custom_plan", "force_generic_plan"])
@pytest.mark.parametrize(
    ("label", "step"),
    [
        ("stuck listing", lambda: operator_queries._list_rows(stuck=True, limit=50)),
        (
            "stats",
            lambda: operator_queries._stats(
                {"since_at": None, "since_seconds": 3600.0, "now": None, "top": 5}
            ),
        ),
    ],
)
def test_stuck_runs_and_the_oldest_pending_are_found_without_walking_the_history(
    history: psycopg.Connection[Any], mode: str, label: str, step: Any
) -> None:
    execute = _first_execute(step())
    plan = _analyze(history, execute.stmt.file, dict(execute.params), mode)
    assert _rows_read_from(plan, _SETTLED_INDEX) <= 10, (label, plan)


def test_stuck_listing_and_stats_read_the_pending_runs(history: psycopg.Connection[Any]) -> None:
    repo = AgentRunRepository(history)
    stuck = repo.list_runs(stuck=True, limit=50)
    assert [run.id for run in stuck] == [f"waiting-{i}" for i in range(300, 250, -1)]
    stats = repo.run_stats(since=timedelta(hours=1))
    assert stats.queue.pending == 300
    age = stats.queue.oldest_pending_age
    assert age is not None and timedelta(hours=1, minutes=59) < age < timedelta(hours=2, minutes=1)


def test_a_pending_run_is_stuck_once_it_has_been_available_for_stuck_after(
    repo: AgentRunRepository,
) -> None:
    waiting = new_run(repo)
    scheduled = new_run(repo, available_at=waiting.created_at + timedelta(hours=1))
    backdated = repo.list_runs(stuck=True, stuck_after=timedelta(0), limit=50)
    assert [run.id for run in backdated] == [waiting.id]  # the scheduled one is not available
    later = repo.list_runs(
        stuck=True,
        stuck_after=timedelta(minutes=30),
        now=waiting.created_at + timedelta(hours=2),
        limit=50,
    )
    assert [run.id for run in later] == [scheduled.id, waiting.id]
    between = repo.list_runs(
        stuck=True,
        stuck_after=timedelta(minutes=30),
        now=waiting.created_at + timedelta(minutes=45),
        limit=50,
    )
    assert [run.id for run in between] == [waiting.id]  # available 45 min vs not yet
