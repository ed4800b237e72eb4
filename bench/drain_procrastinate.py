"""Procrastinate in the drain phase: its worker (`procrastinate worker`, psycopg connector, a
no-op async task), its schema (`procrastinate schema --apply`), a bulk defer through its task
API and the jobs it marks succeeded.

Imported only where procrastinate is installed (`pip install 'agent_runs[compare]'`).
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Final

from procrastinate import App, PsycopgConnector  # type: ignore[import-not-found, unused-ignore]

ENV_DSN: Final = "AGENT_RUNS_BENCH_PROCRASTINATE_DSN"
# Done: the job's status is succeeded; when: the time of its 'succeeded' event.
DONE_SQL: Final = "SELECT count(*) FROM procrastinate_jobs WHERE status = 'succeeded'"
LAST_DONE_SQL: Final = "SELECT max(at) FROM procrastinate_events WHERE type = 'succeeded'"


async def noop() -> None:
    """The drain's task: does nothing."""


def make_app(conninfo: str) -> App:
    """An app with the drain's no-op task; its connector's pool has the library's defaults."""
    app = App(connector=PsycopgConnector(conninfo=conninfo))
    app.task(name="noop", queue="bench")(noop)
    return app


# The app the CLI loads (--app bench.drain_procrastinate.app).
app = make_app(os.environ.get(ENV_DSN, ""))


def _cli(url: str, *args: str) -> tuple[list[str], dict[str, str]]:
    command = [sys.executable, "-m", "procrastinate", "--app", "bench.drain_procrastinate.app"]
    return [*command, *args], {ENV_DSN: url}


def install_command(url: str) -> tuple[list[str], dict[str, str]]:
    return _cli(url, "schema", "--apply")


def worker_command(url: str, concurrency: int) -> tuple[list[str], dict[str, str]]:
    return _cli(url, "--log-level", "warning", "worker", "--concurrency", str(concurrency))


async def _enqueue(url: str, count: int) -> None:
    bound = make_app(url)
    async with bound.open_async():
        await bound.configure_task("noop").batch_defer_async(*({} for _ in range(count)))


def enqueue(url: str, count: int) -> None:
    """`count` jobs in one statement (one transaction), through Procrastinate's own API."""
    asyncio.run(_enqueue(url, count))
