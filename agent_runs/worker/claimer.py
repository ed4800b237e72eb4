"""The claim source: one thread claims runs for every `run_forever` thread of the process.

Each `run_forever` thread is one slot. A claim takes a slot for its run; the slot comes back
once the run's end has committed (with async completion: once the end was handed over), or
once nothing is left to write for it. The claimer claims for all the free slots at once, in one
statement (oldest runs first, up to MAX_BATCH), and queues what it got; a `run_forever` thread
takes the next claimed run, executes it and hands its end to the writer thread
(agent_runs/worker/flusher.py), then takes the next one without waiting for that statement.

With durable completion the writer claims in its batch's own transaction (`claim_with_ends`):
for the slots that batch frees and for the slots already free, which it reserves here first so
that the claimer thread does not claim for them too; the claimer claims for the others.

The claimer is given its statements and its surroundings as functions (claim, claim with ends,
release, reconcile, the wake-ups, the next scheduled run); it holds nothing of the worker.

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
from collections.abc import Callable, Sequence
from datetime import datetime
from queue import Empty, SimpleQueue
from typing import TYPE_CHECKING

from psycopg_pool import PoolClosed

from agent_runs import validation as check
from agent_runs.backoff import Backoff
from agent_runs.display import one_line
from agent_runs.errors import DB_ERRORS
from agent_runs.logs import logger
from agent_runs.models import Finish
from agent_runs.worker.lease import Claimed

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


# The writer's statement: finish_runs for the ends and a claim of up to n runs (Claiming.with_ends).
ClaimWithEnds = Callable[[list[Finish], int], tuple[list[datetime | None] | None, list[Claimed]]]


class Claimer:
    """Claims for the free slots of the process's `run_forever` threads (module docstring)."""

    def __init__(
        self,
        claim: Callable[[int], list[Claimed]],
        *,
        release: Callable[[Sequence[Claimed]], None],
        stopping: threading.Event,
        poll_seconds: float,
        close_timeout: float,
        reconcile: Callable[[], object] = lambda: None,
        wakeups: Callable[[], Wakeups | None] = lambda: None,
        next_available_in: Callable[[], float | None] = lambda: None,
        claim_with_ends: ClaimWithEnds | None = None,
    ) -> None:
        """`claim(n)` claims up to n runs; `release(runs)` releases claimed runs nobody will
        execute; `stopping` set: the worker stops; `close_timeout`: how long close() waits for
        the claimer thread; `claim_with_ends`: the writer's statement (durable completion)."""
        self._claim = claim
        self._release = release
        self._stopping = stopping
        self._poll_seconds = poll_seconds
        self._close_timeout = close_timeout
        self._reconcile = reconcile
        self._wakeups = wakeups
        self._next_available_in = next_available_in
        self._claim_with_ends = claim_with_ends
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

    def leave(self, slot: Slot) -> None:
        """A run_forever thread takes its slot away. Once no thread that goes on is left (or
        the worker stops), the claimed runs that no thread will take now are released."""
        with self._changed:
            self._slots.remove(slot)
            left = self._drain() if self._nobody_takes_runs() else []
            self._changed.notify_all()
        self.release(left)

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
        if count:
            with self._changed:
                self._held -= count
                self._changed.notify_all()

    def release(self, claimed: Sequence[Claimed]) -> None:
        """Release for retry runs claimed for slots and never started; their slots come back."""
        if claimed:
            try:
                self._release(claimed)
            finally:
                self.give_back(len(claimed))

    def claim_with_ends(
        self, finishes: list[Finish]
    ) -> tuple[list[datetime | None] | None, int] | None:
        """The writer's batch of ends (each of a held slot) and, in the same statement, the
        next runs of those slots and of the slots already free, as many as are left for threads
        that go on. Each end's finished_at (None where refused; None for all: in doubt), and
        how many of the ending slots are settled: given their next run or back (the writer
        gives back the others once their ends are written alone).

        None when it claims nothing (async completion, stopping, no slot left): the writer
        writes the ends alone."""
        ending = len(finishes)
        with self._changed:
            if self._claim_with_ends is None or self._ending():
                return None
            wanted = max(0, min(ending + self._free(), check.MAX_BATCH))
            if not wanted:
                return None
            # The free slots are reserved here, so that the claimer thread leaves them alone.
            extra = max(0, wanted - ending)
            self._held += extra
        try:
            finished, claimed = self._claim_with_ends(finishes, wanted)
        except BaseException:
            self.give_back(extra)
            raise
        if finished is None:  # in doubt: the runs found take the reserved free slots first
            settled = min(ending, max(0, len(claimed) - extra))
        else:
            settled = sum(at is not None for at in finished)
        self.batches += 1
        self.items += len(claimed)
        self._deliver(claimed, reserved=settled + extra)
        return finished, settled

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
        claimer at most `close_timeout` (then leaves it, a daemon, to the process's exit)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._close_timeout)
            if thread.is_alive():
                log.warning("the claimer did not end within a lease; leaving it")
        with self._changed:
            left = self._drain()
        self.release(left)

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
        wakeups = self._wakeups()
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
                self._reconcile()
                claimed = self._claim(wanted) if wanted else []
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
                        "database unavailable (%s); claiming again in %.1fs",
                        one_line(exc, with_type=True),
                        delay,
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
            self.batches += 1
            self.items += len(claimed)
            self._deliver(claimed, reserved=wanted)
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
        return self._closed or self._stopping.is_set()

    def _deliver(self, claimed: list[Claimed], *, reserved: int) -> None:
        """`claimed` came for `reserved` held slots (no more runs than slots): queue them for
        the threads, give the other slots back; release them when no thread is left to take
        them (or the worker stops)."""
        with self._changed:
            self._held -= reserved - len(claimed)
            orphaned = self._nobody_takes_runs()
            if not orphaned:
                for one in claimed:
                    self._ready.put(one)
            self._changed.notify_all()
        if orphaned:
            self.release(claimed)

    def _pause(self, seconds: float) -> None:
        with self._changed:
            deadline = time.monotonic() + seconds
            while not self._ending() and (left := deadline - time.monotonic()) > 0:
                self._changed.wait(min(left, WAIT_SLICE_SECONDS))

    def _next_available(self) -> float | None:
        try:
            return self._next_available_in()
        except DB_ERRORS:
            return None  # the poll stays the safety net

    def _idle(self, wakeups: Wakeups | None) -> None:
        """Wait until a wake-up, the safety-net poll or a stop.

        While the listener is up the poll only catches what a notification could miss, so it
        runs every poll_seconds; while it is down, at most every second (when listening was
        meant to be there).
        """
        started = time.monotonic()
        # A run scheduled for later sends no wake-up when it becomes available: a poll slower
        # than a second asks once when that is, and sleeps no longer (one read per idle spell).
        scheduled = self._next_available() if self._poll_seconds > 1.0 else None
        while not self._ending():
            listening = wakeups is not None and wakeups.listening
            interval = self._poll_seconds
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
