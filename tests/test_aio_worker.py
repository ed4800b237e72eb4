"""Coroutine agents in the threaded worker: run on an event loop of the worker thread, with the
threaded agent's rules (cancel seen, lease lost, shutdown, interrupt, errors), in-process and
end to end through `agent-runs worker --agent module:callable`."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from psycopg_pool import ConnectionPool

from agent_runs import AgentRun, AgentRunRepository, RunStatus, create_pool
from agent_runs.worker import AgentResult, RetryableError, RunContext
from tests.helpers import new_run, wait_until
from tests.test_e2e import (  # noqa: F401 - spawn: its fixture
    Spawner,
    history,
    spawn,
    stop,
    terminal,
    wait_for,
)
from tests.test_worker import Background, make_worker, status_of

# What the coroutine agents below saw of where they ran: (thread, running loop) per call.
SEEN: list[tuple[threading.Thread, asyncio.AbstractEventLoop]] = []


@pytest.fixture
def pool(dsn: str) -> Iterator[ConnectionPool]:
    with create_pool(dsn, min_size=1, max_size=8) as p:
        yield p


async def completing_agent(run: AgentRun, ctx: RunContext) -> AgentResult:
    """A coroutine agent (also used through `--agent tests.test_aio_worker:completing_agent`)."""
    SEEN.append((threading.current_thread(), asyncio.get_running_loop()))
    await asyncio.sleep(0.01)
    return AgentResult.completed()


async def waiting_agent(run: AgentRun, ctx: RunContext) -> AgentResult:
    """Awaits until the worker cancels it (used end to end for SIGTERM)."""
    await asyncio.sleep(3600)
    return AgentResult.completed()


class ScriptedCoroutineAgent:
    """An object whose __call__ is a coroutine function: the script step of this attempt."""

    async def __call__(self, run: AgentRun, ctx: RunContext) -> AgentResult:
        step = run.input_payload["script"][
            min(ctx.attempt_no, len(run.input_payload["script"])) - 1
        ]
        await asyncio.sleep(0)
        if step == "retry":
            raise RetryableError("try again")
        if step == "boom":
            raise ValueError("the model said no")
        if step == "interrupt":
            return AgentResult.interrupted("user_interrupt", "stopped by the user")
        if step == "fail":
            return AgentResult.failed("tool_error", "a tool failed")
        if step == "wait":
            await asyncio.sleep(3600)
        if step == "catch_cancel":
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                return AgentResult.failed("cleanup", "cancelled, cleaned up")
        return AgentResult.completed()


def _while_running(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    agent: Any,
    run: AgentRun,
    act: Callable[[], Any],
) -> AgentRun:
    """Run `run` with `agent` in a worker thread; `act` once it is running; the run as ended."""
    with make_worker(pool, agent) as worker:
        background = Background(worker)
        wait_until(lambda: status_of(repo, run.id) == RunStatus.RUNNING)
        if act() is None:
            worker.request_stop()
        ended = background.join()
    assert ended is not None and ended.id == run.id
    return ended


def _run_with(pool: ConnectionPool, agent: Any) -> AgentRun:
    with make_worker(pool, agent) as worker:
        ended = worker.run_once()
    assert ended is not None
    return ended


def test_a_coroutine_agent_runs_on_an_event_loop_of_the_worker_thread_and_keeps_it(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    SEEN.clear()
    first, second = new_run(repo), new_run(repo)
    with make_worker(pool, completing_agent) as worker:
        ended = [worker.run_once(), worker.run_once()]
    assert [r.status if r else None for r in ended] == [RunStatus.COMPLETED] * 2
    assert {r.id for r in ended if r} == {first.id, second.id}
    (thread, loop), (thread_again, loop_again) = SEEN
    assert thread is threading.current_thread() and thread_again is thread
    assert loop_again is loop and not loop.is_running()  # one loop per thread, kept between runs
    assert [a.outcome for a in repo.list_run_attempts(first.id)] == ["completed"]


@pytest.mark.parametrize(
    ("script", "status", "outcomes", "error_type"),
    [
        (["fail"], "failed", ["failed"], "tool_error"),
        (["interrupt"], "interrupted", ["interrupted"], "user_interrupt"),
        (["boom"], "failed", ["failed"], "agent_error"),
        (["retry", "ok"], "completed", ["retry_released", "completed"], None),
    ],
)
def test_a_coroutine_agent_s_ending_maps_as_a_threaded_agent_s(
    pool: ConnectionPool,
    repo: AgentRunRepository,
    *,
    script: list[str],
    status: str,
    outcomes: list[str],
    error_type: str | None,
) -> None:
    run = new_run(repo, input_payload={"script": script})
    for _ in outcomes:
        ended = _run_with(pool, ScriptedCoroutineAgent())
    assert ended.id == run.id and ended.status == status
    assert ended.error_type == error_type
    assert [a.outcome for a in repo.list_run_attempts(run.id)] == outcomes
    if script == ["boom"]:
        assert ended.error_message is not None and "the model said no" in ended.error_message


def test_a_cancel_request_cancels_the_coroutine_and_ends_the_run_cancelled(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    run = new_run(repo)
    ended = _while_running(pool, repo, waiting_agent, run, lambda: repo.request_cancel(run.id))
    assert ended.status == RunStatus.CANCELLED and ended.error_type is None
    assert [a.outcome for a in repo.list_run_attempts(run.id)] == ["cancelled"]


def test_a_coroutine_that_catches_the_cancel_keeps_its_error_on_the_cancelled_run(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    run = new_run(repo, input_payload={"script": ["catch_cancel"]})
    agent = ScriptedCoroutineAgent()
    ended = _while_running(pool, repo, agent, run, lambda: repo.request_cancel(run.id))
    assert ended.status == RunStatus.CANCELLED
    assert (ended.error_type, ended.error_message) == ("cleanup", "cancelled, cleaned up")


def test_a_lost_lease_cancels_the_coroutine_and_the_worker_writes_nothing(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    run = new_run(repo)
    later = datetime.now(UTC) + timedelta(hours=1)  # another process: the reconciler, clock moved
    ended = _while_running(
        pool, repo, waiting_agent, run, lambda: repo.reconcile_expired_leases(now=later)
    )
    assert ended.status == RunStatus.FAILED
    assert ended.error_type == "worker_lease_expired"
    assert [a.outcome for a in repo.list_run_attempts(run.id)] == ["lease_expired"]


def test_a_stopping_worker_cancels_the_coroutine_and_releases_the_run(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    run = new_run(repo)
    ended = _while_running(pool, repo, waiting_agent, run, lambda: None)  # None: stop the worker
    assert ended.status == RunStatus.PENDING
    assert [a.outcome for a in repo.list_run_attempts(run.id)] == ["retry_released"]


async def hung_agent(run: AgentRun, ctx: RunContext) -> AgentResult:
    """A stuck execution: no more heartbeats, and it ignores the worker's cancel."""
    ctx.stop_heartbeat()
    for _ in range(2):
        try:
            await asyncio.sleep(0.75 * ctx.lease_seconds)
        except asyncio.CancelledError:
            SEEN.append((threading.current_thread(), asyncio.get_running_loop()))
    return AgentResult.completed()


def test_a_coroutine_that_outlives_its_lease_is_cancelled_and_its_late_completion_refused(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    SEEN.clear()
    run = new_run(repo)
    with make_worker(pool, hung_agent, lease_seconds=0.5, heartbeat_seconds=0.1) as worker:
        ended = worker.run_once()
    assert len(SEEN) == 1  # the worker cancelled it once the lease had expired
    # Its completion came after the lease: refused, nothing changed; the reconciler converges.
    assert ended is not None and ended.id == run.id and ended.status == RunStatus.RUNNING
    (converged,) = repo.reconcile_expired_leases()
    assert (converged.status, converged.error_type) == ("failed", "worker_lease_expired")
    assert [a.outcome for a in repo.list_run_attempts(run.id)] == ["lease_expired"]


class LoopClient:
    """What an async HTTP or database client is to its loop: made on the running loop, served
    by a task of that loop, usable only while that loop lives."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.requests: asyncio.Queue[asyncio.Future[str]] = asyncio.Queue()
        self.server = self.loop.create_task(self._serve())

    async def _serve(self) -> None:
        while True:
            answer = await self.requests.get()
            answer.set_result("pong")

    async def ping(self) -> str:
        if self.loop is not asyncio.get_running_loop() or self.server.done():
            raise RuntimeError("this client's event loop is gone")
        answer: asyncio.Future[str] = self.loop.create_future()
        await self.requests.put(answer)
        return await answer


class ClientKeepingAgent:
    """A coroutine agent that makes one LoopClient per worker thread and uses it on every run;
    its run's `step` says how the run ends."""

    def __init__(self, repo: AgentRunRepository) -> None:
        self.repo = repo
        self.clients: dict[int, LoopClient] = {}
        self.seen: list[tuple[str, asyncio.AbstractEventLoop, LoopClient]] = []

    async def __call__(self, run: AgentRun, ctx: RunContext) -> AgentResult:
        client = self.clients.get(threading.get_ident())
        if client is None:
            client = self.clients[threading.get_ident()] = LoopClient()
        self.seen.append((run.input_payload["step"], asyncio.get_running_loop(), client))
        assert await client.ping() == "pong"
        step = run.input_payload["step"]
        if step == "retry" and ctx.attempt_no == 1:
            raise RetryableError("the model is busy")
        if step == "boom":
            raise ValueError("the model said no")
        if step == "cancelled by itself":
            raise asyncio.CancelledError
        if step == "cancel requested":
            self.repo.request_cancel(run.id)
            await asyncio.sleep(3600)  # the worker cancels it
        return AgentResult.completed()


def test_a_coroutine_agent_s_thread_keeps_its_loop_and_clients_whatever_a_run_raises(
    pool: ConnectionPool, repo: AgentRunRepository
) -> None:
    agent = ClientKeepingAgent(repo)
    steps = ["ok", "retry", "boom", "cancelled by itself", "cancel requested", "ok"]
    ended: dict[str, list[AgentRun]] = {}
    with make_worker(pool, agent) as worker:
        for step in steps:
            run = new_run(repo, input_payload={"step": step})
            for _ in range(2 if step == "retry" else 1):  # released, then claimed again
                done = worker.run_once()
                assert done is not None and done.id == run.id
                ended.setdefault(step, []).append(done)
    (_, loop, client) = agent.seen[0]
    try:
        assert [step for step, _, _ in agent.seen] == [*steps[:2], "retry", *steps[2:]]
        assert {id(seen) for _, seen, _ in agent.seen} == {id(loop)}  # one loop for every run
        assert {id(used) for _, _, used in agent.seen} == {id(client)}  # and one client
        assert not loop.is_closed() and not client.server.done()
    finally:
        if not loop.is_closed():
            client.server.cancel()
            loop.run_until_complete(asyncio.gather(client.server, return_exceptions=True))
    statuses = {step: [run.status for run in runs] for step, runs in ended.items()}
    assert statuses == {
        "ok": [RunStatus.COMPLETED, RunStatus.COMPLETED],
        "retry": [RunStatus.PENDING, RunStatus.COMPLETED],
        "boom": [RunStatus.FAILED],
        "cancelled by itself": [RunStatus.FAILED],
        "cancel requested": [RunStatus.CANCELLED],
    }


# -- end to end --------------------------------------------------------------------------------


@pytest.mark.e2e
def test_agent_runs_worker_runs_a_coroutine_agent_end_to_end(
    spawn: Spawner,  # noqa: F811 - test_e2e's fixture, imported above
    repo: AgentRunRepository,
) -> None:
    """Through the CLI (the class is instantiated; its __call__ is a coroutine function): one
    run completes; SIGTERM cancels the next one's coroutine, releases the run and exits 0."""
    done = new_run(repo, input_payload={"script": ["ok"]})
    worker = spawn.worker("--agent", "tests.test_aio_worker:ScriptedCoroutineAgent")
    finished = wait_for(repo, done.id, terminal, procs=(worker,))
    assert finished.status == RunStatus.COMPLETED
    assert [a.outcome for a in history(repo, finished)] == ["completed"]
    waiting = new_run(repo, input_payload={"script": ["wait"]})
    wait_for(repo, waiting.id, lambda r: r.status == RunStatus.RUNNING, procs=(worker,))
    assert stop(worker) == 0
    released = repo.get_run(waiting.id)
    assert released is not None and released.status == RunStatus.PENDING
    assert [a.outcome for a in history(repo, released)] == ["retry_released"]
