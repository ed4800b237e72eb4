"""Tasks sharing an async connection take turns: only the task that holds `transaction()` runs
calls inside it. A task started inside the block (create_task, a TaskGroup, a copied context)
is another task: whenever it calls, it waits for the turn, and no rollback of a block it did
not open takes its runs. The same for threads on the synchronous face, and for wait_for_run's
own statements on both faces."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import uuid
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, Final

import psycopg
import pytest

from agent_runs import AgentRun, AgentRunRepository, RunStatus, aio, wait_for_run
from agent_runs.aio import AsyncAgentRunRepository
from tests.helpers import new_run, wait_for_lock_waiters

Conn = psycopg.Connection[Any]
# How long a block stays open while a task it started may run (it must not run inside).
OPEN_SECONDS: Final = 0.2


class Rollback(Exception):
    """Raised in a block to roll it back."""


# Ways to start a task inside a block: each copies the block's context.
Starter = Callable[[Coroutine[Any, Any, AgentRun]], "asyncio.Future[AgentRun]"]
STARTERS: Final[dict[str, Starter]] = {
    "create_task": asyncio.create_task,
    "ensure_future": asyncio.ensure_future,
    "copied context": lambda coro: asyncio.get_running_loop().create_task(
        coro, context=contextvars.copy_context()
    ),
}


async def _create(arepo: AsyncAgentRunRepository) -> AgentRun:
    key = uuid.uuid4().hex[:12]
    return await arepo.create_run(
        thread_id=f"thread-{key}", agent_slug="agent", uid="user", request_id=f"req-{key}"
    )


def _exists(observer: Conn, run: AgentRun) -> bool:
    return (
        observer.execute("SELECT 1 FROM agent_runs WHERE id = %s", (run.id,)).fetchone() is not None
    )


@pytest.mark.parametrize("starter", list(STARTERS))
def test_a_task_started_in_a_transaction_later_calls_in_no_other_tasks_transaction(
    dsn: str, observer: Conn, starter: str
) -> None:
    async def scenario() -> tuple[AgentRun, AgentRun, AgentRun, bool]:
        async with await aio.connect(dsn) as aconn:
            arepo = AsyncAgentRunRepository(aconn)
            go = asyncio.Event()

            async def later() -> AgentRun:
                await go.wait()
                return await _create(arepo)

            async with arepo.transaction():
                own = await _create(arepo)
                child = STARTERS[starter](later())
            # The block committed. Another task's block lets the child call, then rolls back.
            rolled_back: list[AgentRun] = []

            async def other() -> bool:
                with contextlib.suppress(Rollback):
                    async with arepo.transaction():
                        rolled_back.append(await _create(arepo))
                        go.set()
                        await asyncio.sleep(OPEN_SECONDS)
                        done_inside = child.done()
                        raise Rollback
                return done_inside

            done_inside = await asyncio.create_task(other())
            return own, await child, rolled_back[0], done_inside

    own, made, rolled_back, done_inside = asyncio.run(scenario())
    assert not done_inside  # it waited for the other block's end
    assert _exists(observer, own) and not _exists(observer, rolled_back)
    assert _exists(observer, made)  # not taken by a rollback of a block it never was in


def test_a_task_started_in_a_transaction_waits_for_its_end_and_outlives_its_rollback(
    dsn: str, observer: Conn
) -> None:
    async def scenario() -> tuple[AgentRun, AgentRun, bool]:
        async with await aio.connect(dsn) as aconn:
            arepo = AsyncAgentRunRepository(aconn)
            async with asyncio.TaskGroup() as group:
                with contextlib.suppress(Rollback):
                    async with arepo.transaction():
                        own = await _create(arepo)
                        child = group.create_task(_create(arepo))
                        await asyncio.sleep(OPEN_SECONDS)  # the child runs meanwhile
                        done_inside = child.done()
                        raise Rollback
            return own, child.result(), done_inside

    own, made, done_inside = asyncio.run(scenario())
    assert not done_inside  # it waited for the block's end instead of running inside it
    assert not _exists(observer, own)
    assert _exists(observer, made)


def test_the_holding_task_still_runs_its_calls_and_nested_blocks_inside_its_transaction(
    dsn: str, observer: Conn
) -> None:
    async def scenario() -> tuple[AgentRun, AgentRun]:
        async with await aio.connect(dsn) as aconn:
            arepo = AsyncAgentRunRepository(aconn)
            with contextlib.suppress(Rollback):
                async with arepo.transaction():
                    first = await _create(arepo)
                    async with arepo.transaction():
                        second = await _create(arepo)
                    assert await arepo.get_run(second.id) == second
                    raise Rollback
            return first, second

    first, second = asyncio.run(scenario())
    assert not _exists(observer, first) and not _exists(observer, second)


@pytest.mark.parametrize("copied", [False, True], ids=["thread", "thread with a copied context"])
def test_a_thread_started_in_a_sync_transaction_waits_for_its_end_and_outlives_its_rollback(
    repo: AgentRunRepository, observer: Conn, *, copied: bool
) -> None:
    made: list[AgentRun] = []

    def call() -> None:
        made.append(new_run(repo))

    target = contextvars.copy_context().run if copied else (lambda f: f())
    with contextlib.suppress(Rollback), repo.transaction():
        own = new_run(repo)
        thread = threading.Thread(target=target, args=(call,))
        thread.start()
        thread.join(OPEN_SECONDS)
        alive_inside = thread.is_alive()
        raise Rollback
    thread.join(10)
    assert alive_inside and made  # it waited for the block's end, then ran
    assert not _exists(observer, own)
    assert _exists(observer, made[0])


# --- wait_for_run's statements take turns too --------------------------------------------------


def test_async_wait_for_run_waits_for_another_tasks_transaction_and_never_joins_it(
    dsn: str, repo: AgentRunRepository, observer: Conn
) -> None:
    run = new_run(repo)

    async def scenario() -> tuple[AgentRun, AgentRun, bool, list[str]]:
        async with await aio.connect(dsn) as aconn:
            arepo = AsyncAgentRunRepository(aconn)
            with contextlib.suppress(Rollback):
                async with arepo.transaction():
                    rolled_back = await _create(arepo)
                    waiting = asyncio.create_task(
                        aio.wait_for_run(aconn, run.id, timeout_seconds=30)
                    )
                    await asyncio.sleep(OPEN_SECONDS)
                    done_inside = waiting.done()
                    raise Rollback
            await asyncio.sleep(OPEN_SECONDS)  # it registers and listens now
            await asyncio.to_thread(repo.request_cancel, run.id)
            done = await waiting
            cur = await aconn.execute("SELECT pg_listening_channels()")
            return done, rolled_back, done_inside, [row[0] for row in await cur.fetchall()]

    done, rolled_back, done_inside, channels = asyncio.run(scenario())
    assert not done_inside  # neither refused nor run inside the block: it waited
    assert done.status == RunStatus.CANCELLED
    assert not _exists(observer, rolled_back)
    assert channels == []
    assert observer.execute("SELECT count(*) FROM agent_run_waiters").fetchone() == (0,)


def test_a_transaction_begun_while_async_wait_for_run_registers_is_not_nested_in_its(
    dsn: str, repo: AgentRunRepository, observer: Conn, watcher: Conn
) -> None:
    """The registration's transaction waits for a lock on the run row; another task's block
    that begins meanwhile waits for its turn, instead of becoming a savepoint inside it."""
    run = new_run(repo)

    async def scenario() -> tuple[AgentRun, AgentRun]:
        async with await aio.connect(dsn) as aconn:
            arepo = AsyncAgentRunRepository(aconn)
            with observer.transaction():
                observer.execute("SELECT 1 FROM agent_runs WHERE id = %s FOR UPDATE", (run.id,))
                waiting = asyncio.create_task(aio.wait_for_run(aconn, run.id, timeout_seconds=30))
                await asyncio.to_thread(wait_for_lock_waiters, watcher, 1)

                async def block() -> AgentRun:
                    async with arepo.transaction():
                        return await _create(arepo)

                blocking = asyncio.create_task(block())
                await asyncio.sleep(OPEN_SECONDS)
            made = await blocking
            await asyncio.to_thread(repo.request_cancel, run.id)
            return await waiting, made

    done, made = asyncio.run(scenario())
    assert done.status == RunStatus.CANCELLED
    assert _exists(observer, made)


def test_sync_wait_for_run_waits_for_another_threads_transaction_and_never_joins_it(
    dsn: str, conn: Conn, repo: AgentRunRepository, observer: Conn
) -> None:
    run = new_run(repo)
    ended: list[AgentRun | BaseException] = []

    def wait() -> None:
        try:
            ended.append(wait_for_run(conn, run.id, timeout_seconds=30))
        except BaseException as exc:
            ended.append(exc)

    with contextlib.suppress(Rollback), repo.transaction():
        rolled_back = new_run(repo)
        waiter = threading.Thread(target=wait)
        waiter.start()
        waiter.join(OPEN_SECONDS)
        alive_inside = waiter.is_alive()
        raise Rollback
    with psycopg.connect(dsn, autocommit=True) as other:
        AgentRunRepository(other).request_cancel(run.id)
    waiter.join(30)
    assert alive_inside  # neither refused nor run inside the block: it waited
    assert len(ended) == 1 and isinstance(ended[0], AgentRun), ended
    assert ended[0].status == RunStatus.CANCELLED
    assert not _exists(observer, rolled_back)
    listening = conn.execute("SELECT pg_listening_channels()").fetchall()
    assert listening == []


@pytest.fixture
def watcher(dsn: str) -> Iterator[Conn]:
    """A third session, to see who waits on a lock."""
    with psycopg.connect(dsn, autocommit=True) as connection:
        yield connection
