"""The drain as a user runs it: `agent-runs worker --concurrency 16` with every other option at
the CLI's default (the scripted agent, the INFO log, here written to a file as `2>>worker.log`
would), and runs created through the repository's `create_runs`, released by one COMMIT.

The runs are held behind one transaction (`create_runs` in chunks, then COMMIT): none is
visible, and no wake-up is delivered, before that commit; then one `agent_runs_claimable`
per agent slug reaches the worker, as from any application that creates runs. The drain time
runs from just after that commit (the database clock) to the last run's `finished_at`, the
way the drain phase times PgQueuer's burst.
"""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any, Final

from agent_runs import AgentRunRepository
from bench.drain_queues import CONCURRENCY, LISTENING, Conn, Queue

CREATE_CHUNK: Final = 1_000  # create_runs items per statement (its limit)
SLUGS: Final = 4


def user_queue(url: str, mode: str | None, *, options: tuple[str, ...] = ()) -> Queue:
    """The worker started as a user would; `mode` is its `--completion` (None: the default
    only). `options` are added to the command (for measuring one default at a time)."""
    command = [*_agent_runs_command(), "worker", "--dsn", url]
    command += ["--concurrency", str(CONCURRENCY)]
    if mode is not None:
        command += ["--completion", mode]
    command += options
    settings = " ".join(["agent-runs worker", *command[command.index("--concurrency") :]])
    return Queue(
        key=f"agent_runs_cli_{mode}" if mode else "agent_runs_cli",
        url=url,
        command=command,
        env={},
        enqueue=release_runs,
        done_sql="SELECT count(*) FROM agent_runs WHERE status = 'completed'",
        last_done_sql="SELECT max(finished_at) FROM agent_runs",
        settings=settings + ", scripted agent, INFO log to a file",
        check_sql="SELECT count(*) FROM agent_runs WHERE status <> 'completed'",
        ready_sql=LISTENING,
    )


def _agent_runs_command() -> list[str]:
    """The `agent-runs` console script beside this interpreter, else `python -m agent_runs`."""
    script = Path(sys.executable).with_name("agent-runs")
    return [str(script)] if script.exists() else [sys.executable, "-m", "agent_runs"]


def release_runs(conn: Conn, runs: int) -> Any:
    """Create `runs` pending runs in one transaction (create_runs, a chunk per statement);
    returns the database time just after its COMMIT."""
    repo = AgentRunRepository(conn)
    batch = uuid.uuid4().hex[:12]
    with conn.transaction():
        for first in range(0, runs, CREATE_CHUNK):
            repo.create_runs(
                [
                    {
                        "thread_id": f"thread-{batch}-{i}",
                        "agent_slug": f"agent-{i % SLUGS}",
                        "uid": f"user-{i % 101}",
                        "request_id": f"drain-{batch}-{i}",
                        "input_payload": {"prompt": f"drained run {i}", "script": ["ok"]},
                    }
                    for i in range(first, min(first + CREATE_CHUNK, runs))
                ]
            )
    row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]
