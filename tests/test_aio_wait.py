"""agent_runs.aio.wait_for_run: awaits a run's end over LISTEN/NOTIFY with the poll fallback,
refuses what the synchronous one refuses, and leaves its connection idle, whatever ends it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import psycopg
import pytest

from agent_runs import AgentRun, AgentRunRepository, InvalidArgument, RunStatus, aio
from agent_runs.aio import notify as aio_notify
from agent_runs.notify import WAIT_POLL_SECONDS
from tests.helpers import new_run
from tests.test_wait_for_run_flood import Flood

Conn = psycopg.Connection[Any]
AsyncConn = psycopg.AsyncConnection[Any]
_T = TypeVar("_T")


async def _channels(aconn: AsyncConn) -> list[str]:
    cur = await aconn.execute("SELECT pg_listening_channels()")
    return [row[0] for row in await cur.fetchall()]


def _on_connection(dsn: str, body: Callable[[AsyncConn], Coroutine[Any, Any, None]]) -> None:
    """Run `body` on a fresh async connection to `dsn`, in an event loop of its own."""

    async def scenario() -> None:
        async with await aio.connect(dsn) as aconn:
            await body(aconn)

    asyncio.run(scenario())


async def _wait_while(
    dsn: str, run_id: str, timeout: float, meanwhile: Callable[[], object] | None = None
) -> tuple[AgentRun, list[str]]:
    """wait_for_run on a fresh connection, `meanwhile` run in a thread once it waits; the run
    it returned and the channels its connection still listens on."""
    async with await aio.connect(dsn) as aconn:
        waiting = asyncio.create_task(aio.wait_for_run(aconn, run_id, timeout_seconds=timeout))
        if meanwhile is not None:
            await asyncio.sleep(0.1)
            await asyncio.to_thread(meanwhile)
        done = await waiting
        return done, await _channels(aconn)


def test_wait_for_run_returns_when_the_run_completes(dsn: str, repo: AgentRunRepository) -> None:
    run = new_run(repo)
    assert repo.mark_running(run.id, worker_id="w", lease_seconds=60).acquired
    done, channels = asyncio.run(
        _wait_while(
            dsn,
            run.id,
            30,
            lambda: repo.set_terminal_status(run.id, status="completed", worker_id="w"),
        )
    )
    assert done.id == run.id and done.status == RunStatus.COMPLETED
    assert channels == []  # never listened: idle and usable


def test_wait_for_run_returns_a_finished_run_at_once_even_with_no_time_left(
    dsn: str, repo: AgentRunRepository
) -> None:
    run = new_run(repo)
    repo.request_cancel(run.id)
    done, _ = asyncio.run(_wait_while(dsn, run.id, 0))
    assert done.status == RunStatus.CANCELLED


def test_wait_for_run_polls_when_no_notification_comes(
    dsn: str, repo: AgentRunRepository, observer: Conn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(aio_notify, "WAIT_POLL_SECONDS", 0.05)
    run = new_run(repo)
    silent = "UPDATE agent_runs SET status = 'cancelled', finished_at = now() WHERE id = %s"
    # As if the notification was lost (e.g. behind a pooler): only a poll can see the end.
    done, _ = asyncio.run(_wait_while(dsn, run.id, 30, lambda: observer.execute(silent, [run.id])))
    assert done.status == RunStatus.CANCELLED


def test_wait_for_run_times_out_and_leaves_the_connection_usable(
    dsn: str, repo: AgentRunRepository
) -> None:
    run = new_run(repo)

    async def body(aconn: AsyncConn) -> None:
        with pytest.raises(TimeoutError, match="pending"):
            await aio.wait_for_run(aconn, run.id, timeout_seconds=0.3)
        with pytest.raises(TimeoutError):
            await aio.wait_for_run(aconn, run.id, timeout_seconds=0)
        assert await _channels(aconn) == []
        assert await aio.AsyncAgentRunRepository(aconn).get_run(run.id) == run

    _on_connection(dsn, body)


def test_a_cancelled_wait_leaves_the_connection_idle_and_unlistened(
    dsn: str, repo: AgentRunRepository
) -> None:
    run = new_run(repo)

    async def body(aconn: AsyncConn) -> None:
        waiting = asyncio.create_task(aio.wait_for_run(aconn, run.id, timeout_seconds=30))
        await asyncio.sleep(0.2)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert await _channels(aconn) == []
        with pytest.raises(TimeoutError):  # asyncio's own timeout works the same way
            async with asyncio.timeout(0.2):
                await aio.wait_for_run(aconn, run.id, timeout_seconds=30)
        assert await _channels(aconn) == []

    _on_connection(dsn, body)


@pytest.mark.parametrize(
    ("run_id", "timeout", "match"),
    [
        ("no-such-run", 1.0, "no such run"),
        ("", 1.0, "run_id"),
        ("a\x00b", 1.0, "run_id"),
        ("ok", -1, "timeout_seconds"),
        ("ok", float("nan"), "timeout_seconds"),
        ("ok", "5", "timeout_seconds"),
    ],
)
def test_wait_for_run_refuses_bad_arguments_and_unknown_runs(
    dsn: str, run_id: str, timeout: Any, match: str
) -> None:
    async def body(aconn: AsyncConn) -> None:
        with pytest.raises(InvalidArgument, match=match):
            await aio.wait_for_run(aconn, run_id, timeout_seconds=timeout)
        assert await _channels(aconn) == []

    _on_connection(dsn, body)


def test_wait_for_run_refuses_a_connection_inside_a_transaction(dsn: str) -> None:
    async def body(aconn: AsyncConn) -> None:
        async with aconn.transaction():
            with pytest.raises(InvalidArgument, match="idle autocommit"):
                await aio.wait_for_run(aconn, "any", timeout_seconds=1)

    _on_connection(dsn, body)


def test_wait_for_run_registers_its_interest_while_it_waits_and_removes_it(
    dsn: str, repo: AgentRunRepository, observer: Conn
) -> None:
    """A run's end notifies only registered waiters (agent_runs.waiters): the async waiter
    registers before its first read and leaves no registration behind."""
    run = new_run(repo)
    count = "SELECT count(*) FROM agent_run_waiters WHERE run_id = %s"
    seen: list[object] = []

    def finish() -> None:
        seen.append(observer.execute(count, [run.id]).fetchone())
        repo.request_cancel(run.id)

    done, _ = asyncio.run(_wait_while(dsn, run.id, 30, finish))
    assert done.status == RunStatus.CANCELLED
    assert seen == [(1,)]
    assert observer.execute(count, [run.id]).fetchone() == (0,)


def _in_thread(scenario: Callable[[], Coroutine[Any, Any, _T]], timeout: float) -> _T:
    """asyncio.run(scenario()) in a thread of its own: a scenario that hangs fails the test
    (after `timeout` seconds) instead of hanging the suite."""
    answer: list[_T] = []
    runner = threading.Thread(target=lambda: answer.append(asyncio.run(scenario())), daemon=True)
    runner.start()
    runner.join(timeout)
    assert not runner.is_alive(), f"still waiting after {timeout:g} seconds"
    assert answer, "the scenario raised (see the thread's traceback)"
    return answer[0]


def test_wait_for_run_s_deadline_holds_while_other_notifications_pour_in(
    dsn: str, repo: AgentRunRepository
) -> None:
    """Past FLOOD_NOTIFICATIONS in one slice the waiter closes its listener (never reading
    what the server queued for it) and polls until its deadline."""
    run = new_run(repo)

    async def scenario() -> tuple[float, list[str]]:
        async with await aio.connect(dsn) as aconn:
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="still pending"):
                await aio.wait_for_run(aconn, run.id, timeout_seconds=1)
            return time.monotonic() - started - 1, await _channels(aconn)

    with Flood(dsn):
        time.sleep(0.5)
        late, channels = _in_thread(scenario, 30)
    assert late < WAIT_POLL_SECONDS, f"returned {late:.1f}s after its deadline"
    assert channels == []


def test_a_waiter_s_run_is_seen_ending_while_other_notifications_pour_in(
    dsn: str, repo: AgentRunRepository
) -> None:
    run = new_run(repo)
    finisher = threading.Timer(1.0, lambda: repo.request_cancel(run.id))

    async def scenario() -> tuple[AgentRun, float]:
        async with await aio.connect(dsn) as aconn:
            started = time.monotonic()
            finisher.start()
            done = await aio.wait_for_run(aconn, run.id, timeout_seconds=60)
            return done, time.monotonic() - started

    with Flood(dsn):
        done, seen_after = _in_thread(scenario, 30)
    finisher.join()
    assert done.status == RunStatus.CANCELLED
    assert seen_after < 1 + 2 * WAIT_POLL_SECONDS, f"seen {seen_after:.1f}s after"
