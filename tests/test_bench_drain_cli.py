"""The drain phase's worker as a user runs it: started with the CLI's defaults, its runs released
by one COMMIT."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg

import agent_runs
from bench.drain_cli import CREATE_CHUNK, SLUGS, release_runs, user_queue
from tests.test_notify import received


def test_the_worker_is_started_with_the_cli_defaults() -> None:
    queue = user_queue("postgresql://bench@localhost/db", "async")
    command = queue.command
    assert command[command.index("--concurrency") + 1] == "16"
    assert command[command.index("--completion") + 1] == "async"
    assert command[command.index("worker") - 1].endswith(("agent-runs", "agent_runs"))
    for option in ("--agent", "--log-level", "--lease-seconds", "--poll-seconds", "--max-tries"):
        assert option not in command  # left at the CLI's default
    assert queue.key == "agent_runs_cli_async"


def test_release_runs_creates_every_run_in_one_transaction(
    dsn: str, observer: psycopg.Connection[Any]
) -> None:
    runs = 2 * CREATE_CHUNK + 5  # three create_runs statements
    # A listener that runs no statement of its own (psycopg 3.2.1 hands notifications that
    # arrive during a statement to handlers, not to notifies()).
    with psycopg.connect(dsn, autocommit=True) as listener:
        listener.execute("LISTEN agent_runs_claimable")
        listener.execute("LISTEN agent_runs_finished")  # the sentinel's channel
        with agent_runs.connect(dsn) as conn:
            released_at = release_runs(conn, runs)
        heard = [
            payload
            for channel, payload in received(listener, observer)
            if channel == "agent_runs_claimable"
        ]
    assert isinstance(released_at, datetime)
    row = observer.execute(
        "SELECT count(*), count(DISTINCT agent_slug), max(created_at),"
        " count(*) FILTER (WHERE status = 'pending') FROM agent_runs"
    ).fetchone()
    assert row is not None
    count, slugs, last_created, pending = row
    assert (count, slugs, pending) == (runs, SLUGS, runs)
    assert last_created <= released_at
    # One wake-up per agent slug: the three statements' notifications were one transaction's
    # (PostgreSQL folds identical ones of a transaction into one), not one per statement.
    assert sorted(heard) == sorted(f"agent-{i}" for i in range(SLUGS))
