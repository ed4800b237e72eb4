"""list_run_listings: the runs table's listing (dashboard /runs and overview, `agent-runs runs`)
carries no payload, manifest, error message or trace context and makes the server read none of
them, however large; it lists what list_run_summaries lists, with the same filters and pages."""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from agent_runs import (
    AgentRun,
    AgentRunRepository,
    RunListing,
    RunStatus,
    RunSummary,
    manifest_fingerprint,
)
from agent_runs.repository.operator_queries import runs_cursor

Conn = psycopg.Connection[Any]
MakeRun = Callable[..., AgentRun]
MakeAttempt = Callable[..., Any]

BIG = 2 * 1024 * 1024  # bytes of each large document
LISTED_FIELDS = {
    "id",
    "status",
    "agent_slug",
    "thread_id",
    "uid",
    "created_at",
    "error_type",
    "attempt_count",
    "last_worker_id",
}


def big_document() -> dict[str, str]:
    """About BIG bytes of random hex: compresses little, so it is stored out of line (TOAST)."""
    return {"blob": secrets.token_hex(BIG // 2)}


@pytest.fixture
def heavy(make_run: MakeRun, make_attempt: MakeAttempt, t0: datetime) -> list[AgentRun]:
    """Four runs with a 2 MB payload, manifest and error message: settled, live and stuck."""
    t = t0 - timedelta(hours=1)
    manifest = big_document()
    common = {
        "input_payload": big_document(),
        "manifest": manifest,
        "manifest_fingerprint": manifest_fingerprint(manifest),
        "manifest_recorded_at": t,
    }
    runs = [
        make_run(created_at=t, **common),  # pending an hour: stuck
        make_run(
            created_at=t + timedelta(minutes=1),
            status="failed",
            error_type="tool_error",
            error_message="x" * BIG,
            started_at=t,
            finished_at=t + timedelta(minutes=2),
            **common,
        ),
        make_run(
            created_at=t + timedelta(minutes=2),
            status="running",
            worker_id="host-1:a",
            heartbeat_at=t0,
            lease_expires_at=t0 + timedelta(minutes=5),
            started_at=t0,
            agent_slug="other",
            **common,
        ),
        make_run(created_at=t + timedelta(minutes=3), **common),
    ]
    make_attempt(runs[1].id, worker_id="host-2:b", started_at=t, finished_at=t, outcome="failed")
    make_attempt(runs[2].id, worker_id="host-1:a", started_at=t0, lease_expires_at=t0)
    return runs


def listed(summary: RunSummary) -> RunListing:
    """What a listing of this summary's run holds."""
    run = dataclasses.asdict(summary.run)
    return RunListing(
        **{k: run[k] for k in LISTED_FIELDS - {"attempt_count", "last_worker_id"}},
        attempt_count=summary.attempt_count,
        last_worker_id=summary.last_worker_id,
    )


def toast_blocks_read(conn: Conn, observer: Conn) -> int:
    """Blocks of agent_runs' TOAST table read so far (conn's statistics flushed first)."""
    conn.execute("SELECT pg_stat_force_next_flush()")  # flushed before this call returns
    observer.execute("SELECT pg_stat_clear_snapshot()")
    row = observer.execute(
        "SELECT coalesce(toast_blks_read, 0) + coalesce(toast_blks_hit, 0)"
        " FROM pg_statio_user_tables WHERE relname = 'agent_runs'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def test_a_listing_holds_only_what_a_runs_table_shows() -> None:
    assert {f.name for f in dataclasses.fields(RunListing)} == LISTED_FIELDS
    listing = RunListing("r", RunStatus.PENDING, "a", "t", "u", datetime.now(UTC), None, 0, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        listing.id = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    "filters",
    [
        {},
        {"statuses": ["failed", "running"]},
        {"agent_slug": "other"},
        {"worker": "host-1"},
        {"stuck": True},
        {"limit": 2},
        {"since": timedelta(minutes=90), "limit": 3},
    ],
)
def test_listings_are_the_summaries_without_their_documents(
    repo: AgentRunRepository, heavy: list[AgentRun], t0: datetime, filters: dict[str, Any]
) -> None:
    summaries = repo.list_run_summaries(**filters, now=t0)
    assert summaries, filters
    assert repo.list_run_listings(**filters, now=t0) == [listed(s) for s in summaries]


def test_listing_pages_follow_the_same_cursor(
    repo: AgentRunRepository, heavy: list[AgentRun]
) -> None:
    first = repo.list_run_listings(limit=3)
    rest = repo.list_run_listings(limit=3, before=runs_cursor(first[-1]))
    assert [r.id for r in first + rest] == [r.id for r in reversed(heavy)]
    assert runs_cursor(first[-1]) == runs_cursor(repo.list_runs(limit=3)[-1])


def test_the_listing_reads_no_large_document_and_the_summaries_do(
    conn: Conn, observer: Conn, repo: AgentRunRepository, heavy: list[AgentRun]
) -> None:
    """The server reads no TOAST block for a listing: 2 MB documents stay on disk. The same
    measure counts the blocks list_run_summaries reads for its whole runs."""
    before = toast_blocks_read(conn, observer)
    assert [r.attempt_count for r in repo.list_run_listings()] == [0, 1, 1, 0]
    assert toast_blocks_read(conn, observer) == before
    repo.list_run_summaries()
    assert toast_blocks_read(conn, observer) - before > 4 * BIG // 8192 // 2


def test_the_runs_page_and_overview_stay_small_with_large_documents(
    client: Any, heavy: list[AgentRun]
) -> None:
    page = client.get("/runs")
    assert page.status_code == 200
    assert all(run.id in page.text for run in heavy)
    assert "tool_error" in page.text and "host-1:a" in page.text
    assert len(page.content) < 100_000, len(page.content)
    overview = client.get("/")
    assert overview.status_code == 200
    stuck = overview.text.split('id="stuck"', 1)[1].split("</section>", 1)[0]
    assert heavy[0].id in stuck
    assert len(overview.content) < 200_000, len(overview.content)
