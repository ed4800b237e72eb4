"""PgQueuer in the drain phase: its worker (what `pgq run` starts: its supervisor on uvloop, the
asyncpg driver, a no-op entrypoint), its schema (`pgq install`), a bulk enqueue through its
Queries API and its log of finished jobs.

Imported only where pgqueuer is installed (`pip install 'agent_runs[compare]'`).
"""

from __future__ import annotations

import asyncio
import importlib
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import asyncpg  # type: ignore[import-not-found, import-untyped, unused-ignore]
import pgqueuer  # type: ignore[import-not-found, unused-ignore]
from pgqueuer import AsyncpgDriver, Job, QueueManager  # type: ignore[import-not-found, unused-ignore]
from pgqueuer.queries import Queries  # type: ignore[import-not-found, unused-ignore]

ENV_DSN: Final = "AGENT_RUNS_BENCH_PGQUEUER_DSN"
ENTRYPOINT: Final = "noop"
# Done: the job left the queue and its 'successful' row is in the log (written in batches).
DONE_SQL: Final = "SELECT count(*) FROM pgqueuer_log WHERE status = 'successful'"
LAST_DONE_SQL: Final = "SELECT max(created) FROM pgqueuer_log WHERE status = 'successful'"


async def noop(job: Job) -> None:
    """The drain's job handler: does nothing."""


@asynccontextmanager
async def create_pgqueuer() -> AsyncIterator[QueueManager]:
    """The factory `pgq run` starts: one asyncpg connection, one no-op entrypoint."""
    connection = await asyncpg.connect(os.environ[ENV_DSN])
    manager = QueueManager(Queries(AsyncpgDriver(connection)))
    manager.entrypoint(ENTRYPOINT)(noop)
    try:
        yield manager
    finally:
        await connection.close()


def _pgq(url: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "pgqueuer", "--pg-dsn", url, *args]


def install_command(url: str) -> tuple[list[str], dict[str, str]]:
    return _pgq(url, "install"), {}


def worker_command(url: str, batch_size: int) -> tuple[list[str], dict[str, str]]:
    return [sys.executable, "-m", "bench.drain_pgqueuer", str(batch_size)], {ENV_DSN: url}


def main() -> None:
    """The worker process: `pgq run bench.drain_pgqueuer:create_pgqueuer --batch-size N`, through
    pgqueuer.run (the same supervisor, on uvloop as its CLI) because `pgq run` itself fails
    parsing its --log-level default with the typer installed here."""
    work = pgqueuer.run(create_pgqueuer, batch_size=int(sys.argv[1]))
    try:
        uvloop = importlib.import_module("uvloop")
    except ImportError:
        asyncio.run(work)
    else:
        uvloop.run(work)


async def _enqueue(url: str, count: int) -> None:
    connection = await asyncpg.connect(url)
    try:
        queries = Queries(AsyncpgDriver(connection))
        await queries.enqueue([ENTRYPOINT] * count, [None] * count, [0] * count)
    finally:
        await connection.close()


def enqueue(url: str, count: int) -> None:
    """`count` jobs in one statement (one transaction), through PgQueuer's own API."""
    asyncio.run(_enqueue(url, count))


if __name__ == "__main__":
    main()
