"""`make dashboard` and `make screenshots`: an embedded PostgreSQL with the demo's workload, a
sub-agent tree and a trickle of live runs, served by the dashboard.

`python -m dev.dashboard_demo [--port N]` serves until Ctrl-C and stops everything it
started (the worker process, the embedded server) on the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Final

from agent_runs.db import connect
from agent_runs.migrate import apply_migrations
from agent_runs.repository import AgentRunRepository

LIVE_SLUG: Final = "live-demo"
# What the trickle of live runs does, in turn.
LIVE_SCRIPTS: Final = (["sleep:4"], ["ok"], ["retry", "sleep:2"], ["fail:tool_error"], ["sleep:6"])


def seed_tree(repo: AgentRunRepository) -> str:
    """A planner run with sub-agent runs in several states; returns the planner's id."""
    key = uuid.uuid4().hex[:6]
    root = repo.create_run(
        thread_id=f"support-{key}",
        agent_slug="planner",
        uid="alice",
        request_id=f"tree-{key}",
        input_payload={"goal": "answer the customer's refund question", "budget": 3},
    )
    repo.mark_running(root.id, worker_id=f"orchestrator:{key}", lease_seconds=3600)
    steps = [
        ("researcher", "completed", None),
        ("writer", "failed", "tool_error"),
        ("reviewer", "running", None),
        ("translator", "pending", None),
    ]
    for n, (slug, status, error) in enumerate(steps):
        child = repo.create_run(
            thread_id=f"support-{key}-{slug}",
            agent_slug=slug,
            uid="alice",
            request_id=f"tree-{key}-{n}",
            run_type="subagent",
            created_by_run_id=root.id,
            input_payload={"step": n, "from": "planner"},
        )
        if status == "pending":
            continue
        owner = f"sub-{slug}:{key}"
        repo.mark_running(child.id, worker_id=owner, lease_seconds=3600)
        if status != "running":
            repo.set_terminal_status(
                child.id,
                status=status,
                worker_id=owner,
                error_type=error,
                error_message="search API answered 429 Too Many Requests" if error else None,
            )
    return root.id


@contextmanager
def live_trickle(dsn: str, every: float = 4.0) -> Iterator[None]:
    """A worker process on LIVE_SLUG and a thread that enqueues a run every `every` seconds."""
    worker = subprocess.Popen(
        [
            *(sys.executable, "-m", "agent_runs", "worker", "--dsn", dsn, "--agent", "scripted"),
            *("--agent-slug", LIVE_SLUG, "--name", "live-worker", "--lease-seconds", "10"),
            *("--max-tries", "2", "--log-level", "WARNING"),
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    stop = threading.Event()

    def enqueue() -> None:
        with connect(dsn) as conn:
            repo = AgentRunRepository(conn)
            for n, script in zip(itertools.count(), itertools.cycle(LIVE_SCRIPTS), strict=False):
                key = uuid.uuid4().hex[:8]
                repo.create_run(
                    thread_id=f"live-{key}",
                    agent_slug=LIVE_SLUG,
                    uid=f"user-{n % 3}",
                    request_id=f"live-{key}",
                    input_payload={"script": script, "n": n},
                )
                if stop.wait(every):
                    return

    feeder = threading.Thread(target=enqueue, name="live-feeder", daemon=True)
    feeder.start()
    try:
        yield
    finally:
        stop.set()
        feeder.join(timeout=5)
        worker.terminate()
        try:
            worker.wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()


@contextmanager
def demo_database(dsn: str | None) -> Iterator[str]:
    """An embedded PostgreSQL (unless `dsn`), migrated, with the demo's finished runs and a
    sub-agent tree."""
    from agent_runs.devtools.worker_demo import run_demo

    with ExitStack() as stack:
        if dsn is None:
            from agent_runs.devtools.embedded import embedded_postgres

            print("starting an embedded PostgreSQL in a temporary directory", flush=True)
            dsn = stack.enter_context(embedded_postgres(prefix="agent_runs-dashboard-")).url
        apply_migrations(dsn)
        run_demo(dsn, lease_seconds=2.0, workers=3, timeout=60.0)
        with connect(dsn) as conn:
            seed_tree(AgentRunRepository(conn))
        yield dsn


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dev.dashboard_demo")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--dsn", default=None, help="use this database instead of an embedded one")
    args = parser.parse_args(argv)
    import uvicorn

    from agent_runs.dashboard import create_app
    from agent_runs.dashboard.hosts import served_hosts
    from agent_runs.dashboard.startup import startup_lines
    from agent_runs.db import create_pool

    with (
        demo_database(args.dsn) as dsn,
        live_trickle(dsn),
        create_pool(dsn, min_size=1, max_size=4) as pool,
    ):
        hosts = served_hosts("127.0.0.1", args.port)
        app = create_app(pool, allow_cancel=True, allowed_hosts=hosts)
        url = f"http://127.0.0.1:{args.port}/"
        lines = startup_lines(url, dsn, allow_cancel=True, token=False, allowed_hosts=hosts)
        print(
            "", *lines, "  (Ctrl-C stops it, the worker and the embedded PostgreSQL)", "", sep="\n"
        )
        with contextlib.suppress(KeyboardInterrupt):
            uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
