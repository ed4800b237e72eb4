"""A run_forever thread: take what the process's claimer claimed for its slot, execute it, hand
its end over; database failures and bugs are logged and retried with capped back-off, never
ending the loop. What it needs of the worker arrives as `LoopingWorker`."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from psycopg_pool import PoolClosed

from agent_runs.backoff import Backoff
from agent_runs.errors import DB_ERRORS
from agent_runs.logs import logger
from agent_runs.worker.claimer import WAIT_SLICE_SECONDS, Claimed, Claimer, Slot
from agent_runs.worker.executor import ExecutingWorker, execute
from agent_runs.worker.heartbeat import Lease
from agent_runs.worker.text import one_line

if TYPE_CHECKING:  # telemetry off never imports it
    from agent_runs.telemetry import Telemetry

log = logger("agent_runs.worker")


class LoopingWorker(ExecutingWorker, Protocol):
    """What a run_forever thread needs of the worker (agent_runs.worker.Worker)."""

    claimer: Claimer
    telemetry: Telemetry | None
    lease_seconds: float
    connection_timeout: float

    def release_unstarted(self, claimed: Sequence[Claimed]) -> None: ...


def run_forever(worker: LoopingWorker, stop: threading.Event) -> None:
    """Worker.run_forever: one slot in the claimer for this thread until `stop`."""
    slot = worker.claimer.join(stop)
    handed: list[Lease] = []  # the last run whose end this thread handed over
    try:
        _execute_claimed(worker, slot, handed)
    finally:
        worker.release_unstarted(worker.claimer.leave(slot))
        if handed and worker.completion == "durable":
            worker.flusher.wait_written(
                handed[0], timeout=worker.lease_seconds + worker.connection_timeout
            )


def _execute_claimed(worker: LoopingWorker, slot: Slot, handed: list[Lease]) -> None:
    stop = slot.stop
    backoff = Backoff()
    while not (stop.is_set() or worker.stopping):
        claimed = worker.claimer.take(WAIT_SLICE_SECONDS)
        if claimed is None:
            if worker.claimer.pool_closed:
                log.info("pool closed; worker loop ends")
                return
            continue
        if stop.is_set() and not worker.stopping:
            # Only this thread stops: the run is for an idle thread that goes on, or
            # released unstarted; either way it spends no attempt here.
            if not worker.claimer.put_back(claimed):
                worker.release_unstarted([claimed])
            return
        slot.busy = True
        try:
            _run_claimed(worker, claimed, stop, handed)
        except PoolClosed:
            log.info("pool closed; worker loop ends")
            return
        except (KeyboardInterrupt, SystemExit):
            return  # an agent stopped the process: its fact is written, the worker stops
        except DB_ERRORS as exc:
            delay = backoff.next_delay()
            log.warning("database unavailable (%s); retrying in %.1fs", one_line(exc), delay)
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


def _run_claimed(
    worker: LoopingWorker, claimed: Claimed, stop: threading.Event, handed: list[Lease]
) -> None:
    lease = claimed.lease
    try:
        if worker.telemetry is None:
            execute(worker, claimed.run, lease, stop, claimed.attempt_no, hand_over=True)
        else:  # the attempt's span, claimed in the claimer thread, is current here
            with worker.telemetry.executing(lease.worker_id):
                execute(worker, claimed.run, lease, stop, claimed.attempt_no, hand_over=True)
    finally:
        if not lease.written_later:
            worker.heartbeat.untrack(lease)
            worker.claimer.give_back()
        else:
            handed[:] = [lease]
            if worker.completion == "async":
                worker.claimer.give_back()  # done once handed over; durable: once written
