"""wait_for_run (both faces) listens on a connection of its own, closed rather than cleaned: the
caller's connection never LISTENs, so nothing the server queued for the listener stands between
the caller's connection and its next answer."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, Final

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

import agent_runs
from agent_runs import AgentRun, AgentRunRepository, RunStatus, aio, waiters
from agent_runs import notify as notify_module
from agent_runs.aio import notify as aio_notify
from tests.helpers import new_run, wait_until
from tests.test_wait_for_run_flood import Flood

Conn = psycopg.Connection[Any]
LISTENERS: Final = (
    "SELECT pid FROM pg_stat_activity"
    " WHERE datname = current_database() AND query = 'LISTEN agent_runs_finished'"
)


def _listeners(observer: Conn) -> list[int]:
    return [row[0] for row in observer.execute(LISTENERS).fetchall()]


def _sync_wait(dsn: str, run_id: str, timeout: float, seen: Callable[[int], None]) -> AgentRun:
    """wait_for_run on a fresh connection; `seen` gets the connection's backend pid first."""
    with agent_runs.connect(dsn) as conn:
        seen(conn.info.backend_pid)
        done = agent_runs.wait_for_run(conn, run_id, timeout_seconds=timeout)
        assert conn.execute("SELECT pg_listening_channels()").fetchall() == []
        return done


def _async_wait(dsn: str, run_id: str, timeout: float, seen: Callable[[int], None]) -> AgentRun:
    async def scenario() -> AgentRun:
        async with await aio.connect(dsn) as aconn:
            seen(aconn.info.backend_pid)
            done = await aio.wait_for_run(aconn, run_id, timeout_seconds=timeout)
            cur = await aconn.execute("SELECT pg_listening_channels()")
            assert await cur.fetchall() == []
            return done

    return asyncio.run(scenario())


FACES: Final[dict[str, Callable[[str, str, float, Callable[[int], None]], AgentRun]]] = {
    "sync": _sync_wait,
    "async": _async_wait,
}


@pytest.mark.parametrize("face", list(FACES))
def test_a_wait_listens_on_a_connection_of_its_own_and_closes_it(
    dsn: str, repo: AgentRunRepository, observer: Conn, face: str
) -> None:
    run = new_run(repo)
    waiter_pids: list[int] = []
    listener_pids: list[int] = []

    def finish_once_listening() -> None:
        wait_until(lambda: bool(waiter_pids) and bool(_listeners(observer)))
        listener_pids.extend(_listeners(observer))
        repo.request_cancel(run.id)

    finisher = threading.Thread(target=finish_once_listening)
    finisher.start()
    done = FACES[face](dsn, run.id, 30, waiter_pids.append)
    finisher.join()
    assert done.status == RunStatus.CANCELLED
    assert len(listener_pids) == 1 and listener_pids[0] not in waiter_pids
    wait_until(lambda: _listeners(observer) == [])  # closed, its backend gone


@pytest.mark.parametrize("face", list(FACES))
def test_a_wait_for_an_ended_or_unknown_run_or_with_no_time_left_opens_no_listener(
    dsn: str, repo: AgentRunRepository, monkeypatch: pytest.MonkeyPatch, face: str
) -> None:
    def refuse(info: psycopg.ConnectionInfo) -> str:
        raise AssertionError("a listener was opened")

    monkeypatch.setattr(waiters, "listener_conninfo", refuse)
    ended, pending = new_run(repo), new_run(repo)
    repo.request_cancel(ended.id)
    assert FACES[face](dsn, ended.id, 30, lambda pid: None).status == RunStatus.CANCELLED
    with pytest.raises(agent_runs.InvalidArgument, match="no such run"):
        FACES[face](dsn, "no-such-run", 30, lambda pid: None)
    with pytest.raises(TimeoutError, match="still pending"):
        FACES[face](dsn, pending.id, 0, lambda pid: None)


@pytest.mark.parametrize("face", list(FACES))
def test_a_wait_whose_listener_cannot_connect_polls(
    dsn: str, repo: AgentRunRepository, monkeypatch: pytest.MonkeyPatch, face: str
) -> None:
    monkeypatch.setattr(waiters, "listener_conninfo", lambda info: "host=127.0.0.1 port=1")
    monkeypatch.setattr(notify_module, "WAIT_POLL_SECONDS", 0.05)
    monkeypatch.setattr(aio_notify, "WAIT_POLL_SECONDS", 0.05)
    run = new_run(repo)
    finisher = threading.Timer(0.3, lambda: repo.request_cancel(run.id))
    finisher.start()
    done = FACES[face](dsn, run.id, 30, lambda pid: None)
    finisher.join()
    assert done.status == RunStatus.CANCELLED


@pytest.mark.parametrize("face", list(FACES))
def test_a_flooded_wait_closes_its_listener_and_keeps_its_deadline(
    dsn: str, repo: AgentRunRepository, observer: Conn, face: str
) -> None:
    run = new_run(repo)
    listening: list[list[int]] = []
    with Flood(dsn):
        time.sleep(0.5)
        # Well before the deadline the flooded listener is gone; the wait polls on.
        watcher = threading.Timer(1.5, lambda: listening.append(_listeners(observer)))
        watcher.start()
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="still pending"):
            FACES[face](dsn, run.id, 3, lambda pid: None)
        late = time.monotonic() - started - 3
        watcher.join()
    assert listening == [[]]
    assert late < waiters.WAIT_POLL_SECONDS, f"returned {late:.1f}s after its deadline"


def test_the_listener_connects_as_the_callers_connection_did(dsn: str) -> None:
    with agent_runs.connect(dsn, password="not-needed-here", application_name="app") as conn:
        got = conninfo_to_dict(waiters.listener_conninfo(conn.info))
        assert got["password"] == "not-needed-here"
        assert got["dbname"] == conn.info.dbname and got["user"] == conn.info.user
        assert got["application_name"] == "app"
        assert str(got["port"]) == str(conn.info.port)
        with psycopg.connect(waiters.listener_conninfo(conn.info)) as listener:
            assert listener.info.dbname == conn.info.dbname
