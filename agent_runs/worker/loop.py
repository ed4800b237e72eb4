"""A run_forever thread: one slot of the claim source; it takes what was claimed for it,
executes it, and hands its end over. Database failures and bugs are logged and retried with
capped back-off, never ending the loop."""

from __future__ import annotations

import threading
from collections.abc import Callable

from psycopg_pool import PoolClosed

from agent_runs.backoff import Backoff
from agent_runs.display import one_line
from agent_runs.errors import DB_ERRORS
from agent_runs.logs import logger
from agent_runs.worker.claimer import WAIT_SLICE_SECONDS, Claimer, Slot
from agent_runs.worker.lease import Claimed, Lease

log = logger("agent_runs.worker")


class SlotThread:
    """The loop of one run_forever thread (module docstring).

    `execute(claimed, stop)` runs a claimed run and hands its end over (Executor.run);
    `wait_written(lease, timeout)` waits for the writer to write a handed end. With durable
    completion a slot comes back once its end is written (the writer gives it back), with async
    completion once it is handed over (here)."""

    def __init__(
        self,
        source: Claimer,
        stop: threading.Event,
        *,
        execute: Callable[[Claimed, threading.Event], object],
        wait_written: Callable[[Lease, float], bool],
        stopping: threading.Event,
        async_completion: bool,
        linger: float,
    ) -> None:
        self._source = source
        self._stop = stop
        self._execute = execute
        self._wait_written = wait_written
        self._stopping = stopping
        self._async_completion = async_completion
        self._linger = linger  # how long run() waits for its last handed end to be written
        self.last_handed: Lease | None = None  # the last run whose end this thread handed over

    def run(self) -> None:
        """Take and execute runs until the thread's stop or the worker's; with durable
        completion, return once the last end it handed over is written (or given up)."""
        slot = self._source.join(self._stop)
        try:
            self._take_and_execute(slot)
        finally:
            self._source.leave(slot)
            if self.last_handed is not None and not self._async_completion:
                self._wait_written(self.last_handed, self._linger)

    def _take_and_execute(self, slot: Slot) -> None:
        stop, source = self._stop, self._source
        backoff = Backoff()
        while not (stop.is_set() or self._stopping.is_set()):
            claimed = source.take(WAIT_SLICE_SECONDS)
            if claimed is None:
                if source.pool_closed:
                    log.info("pool closed; worker loop ends")
                    return
                continue
            if stop.is_set() and not self._stopping.is_set():
                # Only this thread stops: the run is for an idle thread that goes on, or
                # released unstarted; either way it spends no attempt here.
                if not source.put_back(claimed):
                    source.release([claimed])
                return
            slot.busy = True
            try:
                self._run(claimed)
            except PoolClosed:
                log.info("pool closed; worker loop ends")
                return
            except (KeyboardInterrupt, SystemExit):
                return  # an agent stopped the process: its fact is written, the worker stops
            except DB_ERRORS as exc:
                delay = backoff.next_delay()
                log.warning(
                    "database unavailable (%s); retrying in %.1fs",
                    one_line(exc, with_type=True),
                    delay,
                )
                stop.wait(delay)
                continue
            except Exception:  # a bug must not end a long-lived worker; it is logged loudly
                delay = backoff.next_delay()
                log.exception("worker loop error; retrying in %.1fs", delay)
                stop.wait(delay)
                continue
            finally:
                slot.busy = False
            backoff.reset()

    def _run(self, claimed: Claimed) -> None:
        lease = claimed.lease
        try:
            self._execute(claimed, self._stop)
        finally:
            if not lease.written_later:
                self._source.give_back()
            else:
                self.last_handed = lease
                if self._async_completion:
                    self._source.give_back()  # done once handed over; durable: once written
