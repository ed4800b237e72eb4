"""The writer: ends handed over by executing threads, written in batches.

An executing thread hands its run's terminal decision to the writer and goes on at once; a
writer thread that is free takes everything queued (up to a batch) and writes it in one
`finish_runs` statement. Two writer threads take turns, so one batch gathers while another is
written; ends are independent facts, so their order does not matter. The run's
lease stays with the heartbeat until its end is written, so it cannot expire while it waits. A
decision the batch did not write (refused, or a database failure) goes through the completer's
one-run path, with its retries and explanations.

Who hands over: the `run_forever` threads, always. With durable completion (the default) their
slot comes back to the claim source (claimer.py) only once the end is written, so the process
never holds more runs than threads, and a run counts as done only once its end committed. There
the writer also claims, in the batch's own statement and commit (`Claimer.claim_with_ends`,
sql/finish_runs_and_claim.sql), the next runs of the slots the batch frees and of the slots
already free: a slot goes from its run's end to its next run with one commit, not two, and a
refused end keeps its slot until it is written alone. `run_once`
hands over only with the opt-in asynchronous completion (`Worker(completion="async")`), where
the caller is told the decision before it is written.

The loss window is the same either way: a process that dies (SIGKILL, power loss) after an
agent ended and before the end committed leaves its run `running`; its lease then expires and
the reconciler ends it `failed` / `worker_lease_expired`, with a `lease_expired` attempt that
says the outcome is unknown. Never silently lost, never `completed`. `close()` writes
everything first.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Final

import psycopg

from agent_runs.display import one_line
from agent_runs.errors import DB_ERRORS
from agent_runs.logs import logger
from agent_runs.models import AgentRun, Finish
from agent_runs.worker.claimer import Claimer
from agent_runs.worker.completer import Completer
from agent_runs.worker.heartbeat import HeartbeatService
from agent_runs.worker.lease import Lease
from agent_runs.worker.outcome import Decision, finish_of

log = logger("agent_runs.worker")

# Writer threads, each with a statement (and a pooled connection) of its own. With one, the
# process's serial stage is that statement: the server works on one batch while the process
# waits, and 16 threads settle into two halves of 8 taking turns. With two, one batch is
# written while the next gathers, at full size: an in-process drain ran 1.27 × faster, make
# bench's drain 1.11 × (no-op agent; 1.03 × as a user runs it, within its noise).
WRITERS: Final = 2


@dataclass(frozen=True, slots=True)
class _Handed:
    run: AgentRun
    lease: Lease
    decision: Decision
    tag: str
    finish: Finish


class Flusher:
    """Background threads (`writers`, started by the first hand-over) writing terminal
    decisions in batches, each taking what is queued when it is free. With `slots` (durable
    completion), each handed end holds a slot of that claim source until it is written (or
    given up): the writer claims with the ends, and gives the slots back."""

    def __init__(
        self,
        completer: Completer,
        heartbeat: HeartbeatService,
        *,
        max_batch: int,
        slots: Claimer | None = None,
        writers: int = WRITERS,
    ) -> None:
        self._completer = completer
        self._heartbeat = heartbeat
        self._max_batch = max_batch
        self._slots = slots
        self._changed = threading.Condition()
        self._queue: list[_Handed] = []
        self._writing = 0  # handed items taken by a writer and not yet written
        self._unwritten: set[int] = set()  # id() of each lease handed over and not yet written
        self._closing = False
        self._writers = writers
        self._threads: list[threading.Thread] = []
        self.batches = 0
        self.items = 0

    def hand(self, run: AgentRun, lease: Lease, decision: Decision, tag: str) -> bool:
        """Queue `decision` for `run` (a terminal status); waits while max_batch are queued.
        False once closing: the caller writes the end itself."""
        handed = _Handed(run, lease, decision, tag, finish_of(run, lease, decision))
        with self._changed:
            while len(self._queue) >= self._max_batch and not self._closing:
                self._changed.wait()
            if self._closing:
                return False
            self._start()
            lease.finishing = True
            lease.written_later = True
            self._unwritten.add(id(lease))
            self._queue.append(handed)
            self._changed.notify_all()
            return True

    @property
    def pending(self) -> int:
        """Decisions handed over and not yet written."""
        with self._changed:
            return len(self._queue) + self._writing

    def wait_written(self, lease: Lease, timeout: float) -> bool:
        """Wait until the end handed over with `lease` is written (or given up); False if
        `timeout` passed first."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while id(lease) in self._unwritten:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
        return True

    def start(self) -> None:
        """Start the writer threads now rather than at the first end handed over (RuntimeError
        when the system refuses a thread)."""
        with self._changed:
            if not self._closing:
                self._start()

    def _start(self) -> None:
        while len(self._threads) < self._writers:
            name = f"agent-runs-writer-{len(self._threads) + 1}"
            thread = threading.Thread(target=self._loop, name=name, daemon=True)
            thread.start()  # kept only once started: close() never joins a thread that is not
            self._threads.append(thread)

    def close(self, timeout: float | None = None) -> None:
        """Write everything handed over, then stop the threads."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
            threads = list(self._threads)
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _loop(self) -> None:
        while True:
            with self._changed:
                while not self._queue and not self._closing:
                    self._changed.wait()
                if not self._queue:
                    return  # closing, and everything is written
                batch = self._queue[: self._max_batch]
                del self._queue[: self._max_batch]
                self._writing += len(batch)
                self._changed.notify_all()
            settled = 0  # ending slots the batch's statement settled (next run, or back)
            written: list[_Handed] = []
            try:
                finished, in_doubt, settled = self._statement([h.finish for h in batch])
                written = [h for h, at in zip(batch, finished, strict=True) if at is not None]
                self._write_alone(batch, finished, in_doubt)
            except Exception:  # never let the flusher die: the leases then expire, reconciled
                log.exception("flusher round failed unexpectedly")
            finally:
                for handed in batch:
                    self._heartbeat.untrack(handed.lease)
                if self._slots is not None:
                    self._slots.give_back(len(batch) - settled)
                with self._changed:
                    self._unwritten.difference_update(id(handed.lease) for handed in batch)
                    self._writing -= len(batch)
                    self.batches += 1
                    self.items += len(batch)
                    self._changed.notify_all()
            _log_written(written)  # after the bookkeeping: nothing waits for the log line

    def _statement(self, finishes: list[Finish]) -> tuple[list[datetime | None], bool, int]:
        """The batch's statement: each end's finished_at (None: not written by it), whether
        the statement may have committed although its reply was lost, and how many ending slots
        it settled (with durable completion it claims their next runs)."""
        try:
            answer = None if self._slots is None else self._slots.claim_with_ends(finishes)
            if answer is None:
                return self._completer.finish_batch(finishes), False, 0
            finished, settled = answer
            if finished is None:
                return [None] * len(finishes), True, settled
            return finished, False, settled
        except DB_ERRORS as exc:
            log.warning(
                "could not write %d end(s) in a batch (%s)",
                len(finishes),
                one_line(exc, with_type=True),
            )
            return [None] * len(finishes), True, 0
        except psycopg.Error as exc:  # the server refused the statement: nothing was written
            log.warning(
                "the batch of %d end(s) was refused (%s)",
                len(finishes),
                one_line(exc, with_type=True),
            )
            return [None] * len(finishes), False, 0

    def _write_alone(
        self, batch: list[_Handed], finished: list[datetime | None], in_doubt: bool
    ) -> None:
        """What the statement did not write goes one run at a time, where it is explained
        (refused) or confirmed (in doubt)."""
        for handed, finished_at in zip(batch, finished, strict=True):
            if finished_at is not None:
                continue
            try:
                self._completer.finish(
                    handed.run,
                    handed.lease,
                    handed.decision,
                    handed.tag,
                    batched=False,
                    in_doubt=in_doubt,
                )
            except Exception:  # one run's failure must not cost the others theirs
                log.exception("%s: could not write %s", handed.tag, handed.decision.status)


def _log_written(written: list[_Handed]) -> None:
    """One INFO line per batch naming each end it wrote: a line per run cost the writer, the
    serial stage of a busy worker, about a fifth of its rate."""
    if len(written) == 1:
        log.info("%s: %s (written)", written[0].tag, written[0].decision.status)
    elif written:
        each = "; ".join(["%s: %s"] * len(written))
        shown = [part for h in written for part in (h.tag, h.decision.status)]
        log.info("%d ends written: " + each, len(written), *shown)
