"""wait_for_run (both faces) on any autocommit connection: whatever row factory it has (never
used, never changed), and over the whole timeout range that validation accepts (the lock wait
of its registration is capped where PostgreSQL's lock_timeout ends)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import psycopg
import pytest
from psycopg.rows import class_row, dict_row, namedtuple_row

import agent_runs
from agent_runs import AgentRun, AgentRunRepository, RunStatus, aio, waiters
from agent_runs.validation import MAX_TIMEOUT_SECONDS
from tests.helpers import new_run

Conn = psycopg.Connection[Any]


@dataclass
class Point:
    x: int
    y: int


def refusing(cursor: Any) -> Any:
    raise AssertionError("the connection's row factory was used")


ROW_FACTORIES: Final[dict[str, Any]] = {
    "dict_row": dict_row,
    "namedtuple_row": namedtuple_row,
    "class_row": class_row(Point),
    "a factory that refuses": refusing,
}
# Past 2**31 - 1 milliseconds (about 24.8 days) lock_timeout refuses the value.
LONG_TIMEOUTS: Final = [25 * 86400.0, 31 * 86400.0, float(MAX_TIMEOUT_SECONDS)]


def _cancel_later(repo: AgentRunRepository, run: AgentRun) -> threading.Thread:
    def cancel() -> None:
        time.sleep(0.2)
        repo.request_cancel(run.id)

    thread = threading.Thread(target=cancel)
    thread.start()
    return thread


@pytest.fixture(params=list(ROW_FACTORIES))
def row_factory(request: pytest.FixtureRequest) -> Any:
    return ROW_FACTORIES[request.param]


def _sync_wait(dsn: str, run_id: str, timeout: float, **options: Any) -> tuple[AgentRun, Any]:
    """wait_for_run on a fresh connection: the run, and the connection's row factory after."""
    with agent_runs.connect(dsn, **options) as conn:
        done = agent_runs.wait_for_run(conn, run_id, timeout_seconds=timeout)
        with conn.cursor(row_factory=namedtuple_row) as cur:
            listening = cur.execute("SELECT pg_listening_channels()").fetchall()
        assert listening == []
        return done, conn.row_factory


def _async_wait(dsn: str, run_id: str, timeout: float, **options: Any) -> tuple[AgentRun, Any]:
    async def scenario() -> tuple[AgentRun, Any]:
        async with await aio.connect(dsn, **options) as aconn:
            done = await aio.wait_for_run(aconn, run_id, timeout_seconds=timeout)
            async with aconn.cursor(row_factory=namedtuple_row) as cur:
                await cur.execute("SELECT pg_listening_channels()")
                assert await cur.fetchall() == []
            return done, aconn.row_factory

    return asyncio.run(scenario())


FACES: Final[dict[str, Callable[..., tuple[AgentRun, Any]]]] = {
    "sync": _sync_wait,
    "async": _async_wait,
}


@pytest.mark.parametrize("face", list(FACES))
def test_wait_for_run_works_on_a_connection_of_any_row_factory_and_leaves_it(
    dsn: str, repo: AgentRunRepository, observer: Conn, row_factory: Any, face: str
) -> None:
    ended, pending = new_run(repo), new_run(repo)
    repo.request_cancel(ended.id)
    done, left = FACES[face](dsn, ended.id, 0, row_factory=row_factory)
    assert done.id == ended.id and done.status == RunStatus.CANCELLED
    assert left is row_factory
    thread = _cancel_later(repo, pending)
    done, left = FACES[face](dsn, pending.id, 30, row_factory=row_factory)
    thread.join()
    assert done.id == pending.id and done.status == RunStatus.CANCELLED
    assert left is row_factory
    assert observer.execute("SELECT count(*) FROM agent_run_waiters").fetchone() == (0,)


def test_the_repository_works_on_a_connection_of_any_row_factory_inside_a_transaction(
    dsn: str, observer: Conn, row_factory: Any
) -> None:
    with agent_runs.connect(dsn, row_factory=row_factory) as conn:
        repo = AgentRunRepository(conn)
        with repo.transaction():
            run = new_run(repo)
            assert repo.get_run(run.id) == run
        assert conn.row_factory is row_factory
    assert observer.execute(
        "SELECT status FROM agent_runs WHERE id = %s", (run.id,)
    ).fetchone() == ("pending",)


@pytest.mark.parametrize("timeout", LONG_TIMEOUTS)
@pytest.mark.parametrize("face", list(FACES))
def test_wait_for_run_takes_any_timeout_validation_accepts(
    dsn: str, repo: AgentRunRepository, observer: Conn, face: str, timeout: float
) -> None:
    ended, pending = new_run(repo), new_run(repo)
    repo.request_cancel(ended.id)
    done, _ = FACES[face](dsn, ended.id, timeout)
    assert done.status == RunStatus.CANCELLED
    thread = _cancel_later(repo, pending)
    done, _ = FACES[face](dsn, pending.id, timeout)
    thread.join()
    assert done.status == RunStatus.CANCELLED
    assert observer.execute("SELECT count(*) FROM agent_run_waiters").fetchone() == (0,)


@pytest.mark.parametrize("timeout", [0.0, 0.0001, 86400.0, *LONG_TIMEOUTS])
def test_the_registration_s_lock_wait_is_one_postgresql_accepts(
    observer: Conn, timeout: float
) -> None:
    lock_wait, _, _ = waiters.register_statement("run", "waiter", timeout)
    with observer.transaction():
        observer.execute(waiters.LOCK_TIMEOUT, [lock_wait])
        shown = observer.execute("SHOW lock_timeout").fetchone()
    assert shown is not None and shown[0] != "0"  # 0 would wait forever
