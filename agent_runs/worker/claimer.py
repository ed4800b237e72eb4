"""The claimer: one thread claims runs for every `run_forever` thread of the process.

Each `run_forever` thread is one slot. A claim takes a slot for its run; the slot comes back
once the run's end has committed (with async completion: once the end was handed over), or
once nothing is left to write for it. The claimer claims for all the free slots at once, in one
statement (oldest runs first, up to MAX_BATCH), and queues what it got; a `run_forever` thread
takes the next claimed run, executes it and hands its end to the writer thread
(agent_runs/worker/flusher.py), then takes the next one without waiting for that statement.

With durable completion the writer claims for the slots its batch of ends frees in that batch's
own transaction (`refill_wanted`, `refilled`); the claimer claims for the others.

So no more runs are held than there are threads, a run counts as done only once its end
committed, and under load the claim and finish statements carry a batch each, not a run each:
the threads that execute never wait for the database in between (each such wait is a thread
switch per run, which is what a process of many threads spends its time on).

Idle, the claimer waits for a wake-up (when listening), the poll interval or the next run
scheduled for later, and it runs the reconciler every lease_seconds/2. A run claimed while no
thread is left to take it (all left, or the worker stops) is released for retry at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING, Protocol

from psycopg_pool import PoolClosed

from agent_runs import validation as check
from agent_runs.backoff import Backoff
from agent_runs.errors import DB_ERRORS
from agent_runs.logs import logger
from agent_runs.models import AgentRun
from agent_runs.worker.heartbeat import Lease
from agent_runs.worker.text import one_line

if TYPE_CHECKING:
    from agent_runs.notify import Wakeups

log = logger("agent_runs.worker")

# Longest single wait of the claimer or of a thread waiting for a run, so that a stop event set
# by the caller (without request_stop) is seen promptly.
WAIT_SLICE_SECONDS = 1.0


class Slot:
    """One run_forever thread: its stop event, and whether it is executing a run now."""

    __slots__ = ("busy", "stop")

    def __init__(self, stop: threading.Event) -> None:
        self.stop = stop
        self.busy = False

    def goes_on(self) -> bool:
        """Its thread takes more runs (its stop is not set)."""
        return not self.stop.is_set()


@dataclass(frozen=True, slots=True)
class Claimed:
    """A run claimed for a slot, waiting for a thread to execute it."""

    run: AgentRun
    lease: Lease
    attempt_no: int | None  # None: found after a lost reply, the thread reads its attempt


class ClaimingWorker(Protocol):
    """What the claimer needs of the worker it claims for (agent_runs.worker.Worker)."""

    @property
    def stopping(self) -> bool: ...

    @property
    def lease_seconds(self) -> float: ...

    @property
    def connection_timeout(self) -> float: ...

    @property
    def poll_seconds(self) -> float: ...

    def listener(self) -> Wakeups | None: ...

    def maybe_reconcile(self) -> list[AgentRun]: ...

    def claim_for_slots(self, count: int) -> list[Claimed]: ...

    def next_available_in(self) -> float | None: ...

    def release_unstarted(self, claimed: Sequence[Claimed]) -> None: ...


class Claimer:
    """Claims for the free slots of the process's `run_forever` threads (module docstring)."""

    def __init__(self, worker: ClaimingWorker) -> None:
        self._worker = worker
        self._changed = threading.Condition()
        self._slots: list[Slot] = []  # one per run_forever thread
        self._held = 0  # slots taken by a claim (sent, queued, executing, or its end unwritten)
        self._ready: SimpleQueue[Claimed | None] = SimpleQueue()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.pool_closed = False  # the claimer ended because the pool was closed
        self.batches = 0  # claim statements, for tests and logs
        self.items = 0  # runs claimed

    # -- the run_forever threads -----------------------------------------------------------

    def join(self, stop: threading.Event) -> Slot:
        """A run_forever thread adds its slot, claimed for while `stop` is not set (the first
        one starts the claimer thread)."""
        slot = Slot(stop)
        with self._changed:
            self._slots.append(slot)
            if self._thread is None and not self._closed:
                thread = threading.Thread(target=self._loop, name="agent-runs-claimer", daemon=True)
                thread.start()  # kept only once started: close() never joins a thread that is not
                self._thread = thread
            self._changed.notify_all()
        return slot

    def leave(self, slot: Slot) -> list[Claimed]:
        """A run_forever thread takes its slot away. Once no thread that goes on is left (or
        the worker stops), it gets the claimed runs that no thread will take now (the caller
        releases them)."""
        with self._changed:
            self._slots.remove(slot)
            left = self._drain() if self._nobody_takes_runs() else []
            self._changed.notify_all()
        return left

    def put_back(self, claimed: Claimed) -> bool:
        """A run taken by a thread that stops (alone) before it started it: queued again for an
        idle thread that goes on; False when there is none (the caller releases it)."""
        with self._changed:
            if not any(other.goes_on() and not other.busy for other in self._slots):
                return False
            self._ready.put(claimed)
            return True

    def take(self, timeout: float) -> Claimed | None:
        """The next claimed run, or None after `timeout` (or when woken to look at a stop)."""
        try:
            return self._ready.get(timeout=timeout)
        except Empty:
            return None

    def give_back(self, count: int = 1) -> None:
        """`count` slots' runs need nothing more written: they can be claimed for again (all
        at once, so that the next claim is one statement for them all)."""
        with self._changed:
            self._held -= count
            self._changed.notify_all()

    def refill_wanted(self, ending: int) -> int:
        """How many runs to claim in the transaction that writes the ends of `ending` held slots:
        as many of those slots as are left for threads that go on (none while stopping)."""
        with self._changed:
            if self._ending():
                return 0
            return max(0, min(ending, self._free() + ending, check.MAX_BATCH))

    def refilled(self, written: int, claimed: list[Claimed]) -> None:
        """`written` held slots' ends committed in the transaction that claimed `claimed` (no
        more runs than ends): the runs are queued for the threads, the other slots come back."""
        self.batches += 1
        self.items += len(claimed)
        with self._changed:
            self._held += len(claimed) - written
            orphaned = self._nobody_takes_runs()
            if not orphaned:
                for one in claimed:
                    self._ready.put(one)
            self._changed.notify_all()
        if orphaned:
            self._worker.release_unstarted(claimed)

    def interrupt(self) -> None:
        """Wake every thread waiting for a run (the worker stops)."""
        with self._changed:
            waiting = len(self._slots)
            self._changed.notify_all()
        for _ in range(waiting):
            self._ready.put(None)

    def close(self) -> None:
        """Stop the claimer thread; release what it claimed that no thread took.

        A claim whose reply was lost is looked for until its lease ends, so this waits for the
        claimer at most that long (then leaves it, a daemon, to the process's exit)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._worker.lease_seconds + self._worker.connection_timeout)
            if thread.is_alive():
                log.warning("the claimer did not end within a lease; leaving it")
        with self._changed:
            left = self._drain()
        self._worker.release_unstarted(left)

    def _drain(self) -> list[Claimed]:
        """The queued runs, taken out (the caller holds the lock)."""
        left: list[Claimed] = []
        while True:
            try:
                claimed = self._ready.get_nowait()
            except Empty:
                return left
            if claimed is not None:
                left.append(claimed)

    # -- the claimer thread ----------------------------------------------------------------

    def _loop(self) -> None:
        worker = self._worker
        wakeups = worker.listener()
        if wakeups is not None:  # one claimer: one kept wake-up is enough
            wakeups.limit_pending(1)
        backoff = Backoff()
        while True:
            with self._changed:
                if not self._slots and not self._ready.qsize():
                    self._thread = None  # no thread to claim for: the next join starts again
                    return
                while not self._ending() and self._free() <= 0:
                    self._changed.wait(WAIT_SLICE_SECONDS)
                    if not self._ending():
                        break  # look at the reconciler now and then even when all are busy
                if self._ending():
                    return
                wanted = max(0, min(self._free(), check.MAX_BATCH))
                self._held += wanted
            try:
                worker.maybe_reconcile()
                claimed = worker.claim_for_slots(wanted) if wanted else []
            except PoolClosed:
                self.give_back(wanted)
                log.info("pool closed; the claimer ends")
                self.pool_closed = True
                self.interrupt()  # the threads' loops end too
                return
            except BaseException as exc:
                self.give_back(wanted)
                delay = backoff.next_delay()
                if isinstance(exc, DB_ERRORS):
                    log.warning(
                        "database unavailable (%s); claiming again in %.1fs", one_line(exc), delay
                    )
                elif isinstance(exc, Exception):  # a bug must not end the claimer: logged loudly
                    log.exception("claimer error; claiming again in %.1fs", delay)
                else:
                    raise
                self._pause(delay)
                continue
            if not wanted:
                continue
            backoff.reset()
            self._deliver(claimed, wanted)
            if len(claimed) < wanted:  # nothing more is claimable now
                self._idle(wakeups)

    def _free(self) -> int:
        """Slots not taken (the caller holds the lock). A thread whose stop event is set gets no
        more runs: its slot counts only while the run it executes holds it."""
        return sum(slot.busy or slot.goes_on() for slot in self._slots) - self._held

    def _nobody_takes_runs(self) -> bool:
        """No thread will take a queued run: none goes on, or the claimer or the worker stops
        (the caller holds the lock)."""
        return self._ending() or not any(slot.goes_on() for slot in self._slots)

    def _ending(self) -> bool:
        return self._closed or self._worker.stopping

    def _deliver(self, claimed: list[Claimed], wanted: int) -> None:
        """Queue the claimed runs for the threads; release them when no thread is left to take
        them (or the worker stops)."""
        self.batches += 1
        self.items += len(claimed)
        with self._changed:
            self._held -= wanted - len(claimed)
            orphaned = self._nobody_takes_runs()
            if not orphaned:
                for one in claimed:
                    self._ready.put(one)
        if orphaned:
            self._worker.release_unstarted(claimed)

    def _pause(self, seconds: float) -> None:
        with self._changed:
            deadline = time.monotonic() + seconds
            while not self._ending() and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(min(left, WAIT_SLICE_SECONDS))

    def _next_available(self) -> float | None:
        try:
            return self._worker.next_available_in()
        except DB_ERRORS:
            return None  # the poll stays the safety net

    def _idle(self, wakeups: Wakeups | None) -> None:
        """Wait until a wake-up, the safety-net poll or a stop.

        While the listener is up the poll only catches what a notification could miss, so it
        runs every poll_seconds; while it is down, at most every second (when listening was
        meant to be there).
        """
        worker = self._worker
        started = time.monotonic()
        # A run scheduled for later sends no wake-up when it becomes available: a poll slower
        # than a second asks once when that is, and sleeps no longer (one read per idle spell).
        scheduled = self._next_available() if worker.poll_seconds > 1.0 else None
        while not self._ending():
            listening = wakeups is not None and wakeups.listening
            interval = worker.poll_seconds
            if wakeups is not None and not listening:
                interval = min(interval, 1.0)
            if scheduled is not None:
                interval = min(interval, scheduled + 0.05)
            left = started + interval - time.monotonic()
            if left <= 0:
                return
            if wakeups is None:
                self._pause(min(left, WAIT_SLICE_SECONDS))
            elif wakeups.wait(min(left, WAIT_SLICE_SECONDS)):
                return
