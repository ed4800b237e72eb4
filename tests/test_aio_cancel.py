"""A task cancelled at each await point of an async repository call: the connection is left idle
(or closed), never inside a transaction nobody knows about; the transition is whole or absent;
a pool gets its connection back healthy. Real locks held by other sessions make each await
point last until the test cancels it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Final

import psycopg
import pytest
from psycopg import pq

from agent_runs import AgentRun, AgentRunRepository, RunStatus, aio, manifest_fingerprint
from agent_runs.aio import AsyncAgentRunRepository
from tests.helpers import OWNER, new_run, read_state, wait_for_lock_waiters, wait_until

Conn = psycopg.Connection[Any]
AsyncConn = psycopg.AsyncConnection[Any]
LEASE: Final = 30.0
IDLE: Final = pq.TransactionStatus.IDLE
MANIFEST: Final = {"model": "m"}

# Each transition, as a call on a run that `prepare` left where the call would change it.
Transition = Callable[[AsyncAgentRunRepository, AgentRun], Coroutine[Any, Any, object]]
TRANSITIONS: Final[dict[str, tuple[str, Transition]]] = {
    "mark_running": (
        "pending",
        lambda r, run: r.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE),
    ),
    "renew_lease": (
        "running",
        lambda r, run: r.renew_lease(run.id, worker_id=OWNER, lease_seconds=LEASE),
    ),
    "release_lease_for_retry": (
        "running",
        lambda r, run: r.release_lease_for_retry(run.id, worker_id=OWNER),
    ),
    "set_terminal_status": (
        "running",
        lambda r, run: r.set_terminal_status(run.id, status="completed", worker_id=OWNER),
    ),
    "request_cancel": ("running", lambda r, run: r.request_cancel(run.id)),
    "record_run_manifest": (
        "running",
        lambda r, run: r.record_run_manifest(
            run.id,
            manifest=MANIFEST,
            fingerprint=manifest_fingerprint(MANIFEST),
            worker_id=OWNER,
        ),
    ),
    "request_cancel_tree": ("running", lambda r, run: r.request_cancel_tree(run.id)),
}


def _prepared(repo: AgentRunRepository, state: str) -> AgentRun:
    run = new_run(repo)
    if state == "running":
        claim = repo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE)
        assert claim.run is not None
        return claim.run
    return run


@pytest.fixture
def watcher(dsn: str) -> Iterator[Conn]:
    """A third session, to see who waits on a lock."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection


async def _cancel_when_waiting(task: asyncio.Task[Any], watcher: Conn) -> None:
    """Cancel `task` once its statement waits on a lock, and see the CancelledError."""
    await asyncio.to_thread(wait_for_lock_waiters, watcher, 1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def _idle_or_closed(aconn: AsyncConn) -> bool:
    return aconn.closed or aconn.info.transaction_status == IDLE


@pytest.mark.parametrize("name", TRANSITIONS)
def test_a_call_cancelled_while_its_statement_waits_on_a_row_lock_writes_nothing(
    name: str, dsn: str, repo: AgentRunRepository, observer: Conn, watcher: Conn
) -> None:
    state, call = TRANSITIONS[name]
    run = _prepared(repo, state)
    before = read_state(observer, run.id)

    async def scenario() -> None:
        async with await aio.connect(dsn) as aconn:
            arepo = AsyncAgentRunRepository(aconn)
            with observer.transaction():
                observer.execute("SELECT 1 FROM agent_runs WHERE id = %s FOR UPDATE", (run.id,))
                task = asyncio.create_task(call(arepo, run))
                await _cancel_when_waiting(task, watcher)
                assert _idle_or_closed(aconn)
            assert read_state(observer, run.id) == before
            assert not aconn.closed  # psycopg cancelled the statement: the session goes on
            again = await arepo.get_run(run.id)
            assert again is not None and again.status == before.run["status"]  # type: ignore[index]

    asyncio.run(scenario())


def test_create_run_cancelled_while_it_waits_on_the_same_request_id_writes_nothing(
    dsn: str, observer: Conn, watcher: Conn
) -> None:
    async def scenario() -> None:
        async with await aio.connect(dsn) as aconn:
            arepo = AsyncAgentRunRepository(aconn)
            with observer.transaction(force_rollback=True):
                observer.execute(
                    "INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid)"
                    " VALUES ('other', 'req', 'other-thread', 'agent', 'u')"
                )
                task = asyncio.create_task(
                    arepo.create_run(thread_id="t", agent_slug="agent", uid="u", request_id="req")
                )
                await _cancel_when_waiting(task, watcher)
                assert _idle_or_closed(aconn)
            assert observer.execute("SELECT count(*) FROM agent_runs").fetchone() == (0,)
            run = await arepo.create_run(
                thread_id="t", agent_slug="agent", uid="u", request_id="req"
            )
            assert run.status == RunStatus.PENDING

    asyncio.run(scenario())


def test_a_call_cancelled_while_it_waits_for_another_tasks_transaction_sends_nothing(
    dsn: str, repo: AgentRunRepository, observer: Conn
) -> None:
    run = new_run(repo)

    async def scenario() -> None:
        async with await aio.connect(dsn) as aconn:
            arepo = AsyncAgentRunRepository(aconn)
            inside = asyncio.Event()
            leave = asyncio.Event()

            async def holder() -> None:
                async with arepo.transaction():
                    await arepo.request_cancel(run.id)
                    inside.set()
                    await leave.wait()

            holding = asyncio.create_task(holder())
            await inside.wait()
            waiting = asyncio.create_task(
                arepo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE)
            )
            await asyncio.sleep(0.05)
            assert not waiting.done()  # it waits for its turn, outside the transaction
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            leave.set()
            await holding
            assert aconn.info.transaction_status == IDLE
        after = repo.get_run(run.id)
        assert after is not None and after.status == RunStatus.CANCELLED
        assert repo.list_run_attempts(run.id) == []  # the cancelled claim never ran

    asyncio.run(scenario())


def test_a_transaction_cancelled_in_a_call_rolls_back_every_call_in_it(
    dsn: str, repo: AgentRunRepository, observer: Conn, watcher: Conn
) -> None:
    first, second = new_run(repo), new_run(repo)
    before = read_state(observer, first.id), read_state(observer, second.id)

    async def scenario() -> None:
        async with await aio.connect(dsn) as aconn:
            arepo = AsyncAgentRunRepository(aconn)

            async def both() -> None:
                async with arepo.transaction():
                    await arepo.mark_running(first.id, worker_id=OWNER, lease_seconds=LEASE)
                    await arepo.mark_running(second.id, worker_id=OWNER, lease_seconds=LEASE)

            with observer.transaction():
                observer.execute("SELECT 1 FROM agent_runs WHERE id = %s FOR UPDATE", (second.id,))
                task = asyncio.create_task(both())
                await _cancel_when_waiting(task, watcher)
            assert _idle_or_closed(aconn)
            assert not aconn.closed

    asyncio.run(scenario())
    assert (read_state(observer, first.id), read_state(observer, second.id)) == before


def _block_commits(observer: Conn) -> None:
    """A deferred constraint trigger that, at each COMMIT touching agent_runs, waits for
    advisory lock 4242: whoever holds it holds every such COMMIT."""
    observer.execute(
        """
        CREATE FUNCTION test_wait_at_commit() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NULL; END $$;
        CREATE CONSTRAINT TRIGGER test_wait_at_commit AFTER INSERT OR UPDATE ON agent_runs
        DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION test_wait_at_commit();
        """
    )


@pytest.mark.parametrize("where", ["lone call", "transaction()"])
def test_a_task_cancelled_at_the_commit_leaves_the_transition_whole_or_absent(
    where: str, dsn: str, repo: AgentRunRepository, observer: Conn, watcher: Conn
) -> None:
    run = new_run(repo)
    before = read_state(observer, run.id)
    _block_commits(observer)

    async def scenario() -> None:
        async with await aio.connect(dsn) as aconn:
            arepo = AsyncAgentRunRepository(aconn)

            async def claim() -> None:
                if where == "lone call":
                    await arepo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE)
                    return
                async with arepo.transaction():
                    await arepo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE)

            with observer.transaction():
                observer.execute("SELECT pg_advisory_xact_lock(4242)")
                task = asyncio.create_task(claim())
                await _cancel_when_waiting(task, watcher)
            assert _idle_or_closed(aconn)

    asyncio.run(scenario())
    after = read_state(observer, run.id)
    assert after.run is not None
    if after.run["status"] == "pending":  # absent, whole: nothing of it
        assert after == before
    else:  # committed before the cancel arrived: whole
        assert after.run["status"] == "running" and len(after.attempts) == 1


def test_a_pool_gets_a_cancelled_calls_connection_back_healthy(
    dsn: str, repo: AgentRunRepository, observer: Conn, watcher: Conn
) -> None:
    run = new_run(repo)

    async def scenario() -> None:
        async with aio.create_pool(dsn, min_size=1, max_size=1) as pool:

            async def claim() -> None:
                async with pool.connection() as aconn:
                    await AsyncAgentRunRepository(aconn).mark_running(
                        run.id, worker_id=OWNER, lease_seconds=LEASE
                    )

            with observer.transaction():
                observer.execute("SELECT 1 FROM agent_runs WHERE id = %s FOR UPDATE", (run.id,))
                task = asyncio.create_task(claim())
                await _cancel_when_waiting(task, watcher)
            async with pool.connection() as aconn:
                assert aconn.info.transaction_status == IDLE
                again = await AsyncAgentRunRepository(aconn).mark_running(
                    run.id, worker_id=OWNER, lease_seconds=LEASE
                )
                assert again.acquired
            assert pool.get_stats().get("connections_lost", 0) == 0

    asyncio.run(scenario())
    assert [a.attempt_no for a in repo.list_run_attempts(run.id)] == [1]


def test_a_second_cancel_during_the_server_side_cancel_leaves_idle_or_closed(
    dsn: str, repo: AgentRunRepository, observer: Conn, watcher: Conn
) -> None:
    """Cancelled again while psycopg cancels the statement: the connection may be closed then
    (its statement may still run to its end on the server), never left in a transaction."""
    run = new_run(repo)

    async def scenario() -> None:
        aconn = await aio.connect(dsn)
        try:
            arepo = AsyncAgentRunRepository(aconn)
            with observer.transaction():
                observer.execute("SELECT 1 FROM agent_runs WHERE id = %s FOR UPDATE", (run.id,))
                task = asyncio.create_task(
                    arepo.mark_running(run.id, worker_id=OWNER, lease_seconds=LEASE)
                )
                await asyncio.to_thread(wait_for_lock_waiters, watcher, 1)
                task.cancel()
                await asyncio.sleep(0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            assert _idle_or_closed(aconn)
        finally:
            await aconn.close()

    asyncio.run(scenario())
    # Once no other session of the database is busy, the claim is whole or absent.
    busy = (
        "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database()"
        " AND pid <> pg_backend_pid() AND state <> 'idle'"
    )
    wait_until(lambda: watcher.execute(busy).fetchone() == (0,))
    after = read_state(observer, run.id)
    assert after.run is not None
    if after.run["status"] == "pending":
        assert after.attempts == []
    else:
        assert after.run["status"] == "running" and len(after.attempts) == 1
