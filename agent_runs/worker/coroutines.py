"""Coroutine agents: an agent whose call gives an awaitable (`async def agent(run, ctx)`, or an
object whose `__call__` is one) runs on an event loop of the worker thread that claimed the run.

Each worker thread keeps one event loop for all the runs it executes, so an agent may keep
loop-bound clients (an HTTP session, an LLM client) between runs. The rules are the threaded
agent's: while the agent runs, the worker checks `ctx.should_stop()` every few milliseconds, and
when the run should stop (cancel requested, lease lost, shutdown) it cancels the agent's task;
the agent sees a CancelledError at its next await, and may catch it to return a result. Ended
that way, the run ends as the stop reason says (cancelled, nothing written, released), as for an
agent that returned on `should_stop()`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Final

# How often the worker asks whether the agent should stop while its coroutine runs.
STOP_POLL_SECONDS: Final = 0.05

_local = threading.local()


class _ThreadLoop:
    """The event loop of one worker thread; closed with the thread's local storage."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def __del__(self) -> None:
        if not self.loop.is_running() and not self.loop.is_closed():
            self.loop.close()


def _thread_loop() -> asyncio.AbstractEventLoop:
    holder: _ThreadLoop | None = getattr(_local, "holder", None)
    if holder is None or holder.loop.is_closed():
        holder = _local.holder = _ThreadLoop()
    return holder.loop


def await_agent(awaitable: Awaitable[Any], should_stop: Callable[[], bool]) -> object:
    """Run an agent's awaitable to its end on this thread's event loop: what it returns (None
    when the worker cancelled it because the run should stop), or what it raises. Whatever the
    agent raises, the loop stays for the thread's next run; only an interrupt that stopped the
    loop before the run's end (Ctrl-C) discards it."""
    loop = _thread_loop()
    supervised = loop.create_task(_supervised(awaitable, should_stop))
    try:
        return loop.run_until_complete(supervised)
    except BaseException:
        if not supervised.done():  # interrupted: no task of this run may live on
            _discard(loop)
        raise


async def _supervised(awaitable: Awaitable[Any], should_stop: Callable[[], bool]) -> object:
    task = asyncio.ensure_future(awaitable)
    stopped = False
    while not task.done():
        await asyncio.wait({task}, timeout=STOP_POLL_SECONDS)
        if not task.done() and not stopped and should_stop():
            task.cancel()
            stopped = True
    if stopped and task.cancelled():
        return None  # it stopped because the worker asked: the stop reason decides the end
    return task.result()


def _discard(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what is left on the loop, let it unwind, close it; the thread makes a new one."""
    pending = asyncio.all_tasks(loop)
    for task in pending:
        task.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
    loop.close()
