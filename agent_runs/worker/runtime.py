"""The Worker: claim a run, execute its agent under a heartbeat, have the end written.

One `Worker` per process. Any number of threads may call `run_once()`/`run_forever()` on it;
they share its pool, its heartbeat thread (one `renew_leases` per round for every lease the
process holds) and its wake-up listener (one LISTEN connection per process). `run_once()`
claims and writes in the calling thread (with other threads' claims and ends when they coincide:
agent_runs/worker/batching.py); `run_forever()` threads execute what the process's claimer
claims for them and hand their ends to its writer thread (claimer.py, flusher.py). A worker only
writes for a run while it can prove its lease: a refused renewal means the lease is lost (write
nothing), and a lease whose renewals kept failing until its expiry by the worker's own monotonic
clock is dropped (write nothing; the reconciler converges it).

The rooms it composes: claims.py (the claim statements and the lost-reply search), executor.py
(one run: cancel checks, the agent call, the decision, the end handed), loop.py (a run_forever
thread), reconciler.py (the reconcile pass); the decision and the writing live in outcome.py and
completer.py.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

from psycopg_pool import ConnectionPool

from agent_runs import validation as check
from agent_runs.backoff import Backoff
from agent_runs.errors import DB_ERRORS, LeaseLost
from agent_runs.logs import logger
from agent_runs.models import AgentRun, Finish
from agent_runs.notify import Wakeups
from agent_runs.repository import AgentRunRepository
from agent_runs.worker import claims, loop
from agent_runs.worker.batching import GroupCommit
from agent_runs.worker.claimer import Claimed, Claimer
from agent_runs.worker.completer import Completer
from agent_runs.worker.connection import connection
from agent_runs.worker.executor import execute
from agent_runs.worker.flusher import Flusher
from agent_runs.worker.heartbeat import HeartbeatService, Lease
from agent_runs.worker.outcome import RELEASE
from agent_runs.worker.protocol import Agent
from agent_runs.worker.reconciler import Reconciler
from agent_runs.worker.text import one_line

if TYPE_CHECKING:  # telemetry off never imports it
    from agent_runs.telemetry import Telemetry

log = logger("agent_runs.worker")

T = TypeVar("T")

# With wake-ups, an idle claimer is woken at once by new runs; the poll only catches what a
# notification could miss (while the listener reconnects), so it can be slow: 10 s keeps an idle
# worker process at about 0.1 claim per second.
LISTENING_POLL_SECONDS = 10.0


class Worker:
    """Claims runs and executes them with `agent`; see agent_runs.worker.outcome for how an
    execution's end is decided and agent_runs.worker.completer for how it is written."""

    def __init__(
        self,
        pool: ConnectionPool,
        agent: Agent,
        *,
        name: str | None = None,
        lease_seconds: float = 60,
        heartbeat_seconds: float | None = None,
        max_tries: int = 3,
        poll_seconds: float | None = 1.0,
        agent_slugs: Sequence[str] | None = None,
        listen_dsn: str | None = None,
        completion: str = "durable",
        telemetry: Telemetry | None = None,
    ) -> None:
        if name is None:
            name = f"{socket.gethostname()}-{os.getpid()}"[: check.MAX_WORKER_NAME_LENGTH]
        self.pool = pool
        self.agent = agent
        self.name = check.worker_name(name)
        self.lease_seconds = check.lease_seconds(lease_seconds)
        self.heartbeat_seconds = check.heartbeat_seconds(
            self.lease_seconds / 3 if heartbeat_seconds is None else heartbeat_seconds,
            self.lease_seconds,
        )
        self.max_tries = check.max_tries(max_tries)
        self.listen_dsn = check.optional_dsn("listen_dsn", listen_dsn)
        if poll_seconds is None:  # with wake-ups the poll is only a safety net
            poll_seconds = LISTENING_POLL_SECONDS if listen_dsn else 1.0
        self.poll_seconds = check.poll_seconds(poll_seconds)
        self.agent_slugs = check.agent_slugs(agent_slugs)
        # How long one database call may wait for a pooled connection (a reconnect included).
        self.connection_timeout = max(1.0, min(5.0, self.lease_seconds / 2))
        # OpenTelemetry (agent_runs.telemetry): its repositories record claims, ends and
        # reconciles; the heartbeat, renewals and let-go attempts; None: off.
        self.telemetry = telemetry
        if telemetry is not None:
            telemetry.observe_through(pool)
        self.heartbeat = HeartbeatService(
            pool,
            lease_seconds=self.lease_seconds,
            interval=self.heartbeat_seconds,
            timeout=self.connection_timeout,
            telemetry=telemetry,
        )
        self.completer = Completer(
            self.repository,
            lease_seconds=self.lease_seconds,
            retry_cap=max(0.2, self.heartbeat_seconds),
            max_tries=self.max_tries,
        )
        # "async": run_once's ends are written in the background too, and a run_forever slot
        # comes back once its end is handed over, not once it committed.
        self.completion = check.completion(completion)
        # run_forever threads: one claimer claims for their free slots, one writer writes ends.
        self.claimer = Claimer(self)
        self.flusher = Flusher(
            self.completer,
            self.heartbeat,
            max_batch=check.MAX_BATCH,
            on_written=self._written if self.completion == "durable" else None,
            # durable: a batch of ends claims its slots' next runs in its own transaction
            refill=self if self.completion == "durable" else None,
        )
        # run_once threads that claim at the same time share one claim statement.
        self.claiming = GroupCommit(partial(claims.claim_batch, self), max_batch=check.MAX_BATCH)
        # 0 while all is well; non-zero once an agent asked the process to exit.
        self.exit_code = 0
        self._stopping = threading.Event()
        self.reconciler = Reconciler(self.repository, interval=self.lease_seconds / 2)
        self._wakeups_lock = threading.Lock()
        self._wakeups: Wakeups | None = None

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def listening(self) -> bool:
        """True while this process's wake-up listener has LISTEN in force."""
        wakeups = self._wakeups
        return wakeups is not None and wakeups.listening

    def start_threads(self) -> None:
        """Start the worker's own threads now (heartbeat, writer, wake-up listener) rather than
        at first use, so that a process short of threads fails before it claims anything
        (RuntimeError; close() stops those that started)."""
        self.heartbeat.start()
        self.flusher.start()
        self.listener()

    def request_stop(self) -> None:
        """Stop claiming and ask every executing agent to stop (SIGTERM/SIGINT)."""
        self._stopping.set()
        wakeups = self._wakeups
        if wakeups is not None:
            wakeups.interrupt()
        self.claimer.interrupt()

    def close(self) -> None:
        """Stop claiming (releasing claimed runs no thread took), write what the writer holds,
        stop the heartbeat thread and the wake-up listener. The pool belongs to the caller."""
        self.claimer.close()
        self.flusher.close()
        self.heartbeat.close()
        with self._wakeups_lock:
            wakeups, self._wakeups = self._wakeups, None
        if wakeups is not None:
            wakeups.close()

    def __enter__(self) -> Worker:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def new_owner_token(self) -> str:
        """A fresh owner token per claim: a restarted worker never inherits an old lease."""
        return f"{self.name}:{uuid.uuid4().hex}"

    @contextmanager
    def repository(self) -> Iterator[AgentRunRepository]:
        with connection(self.pool, timeout=self.connection_timeout) as conn:
            yield AgentRunRepository(conn, telemetry=self.telemetry)

    # -- loops -----------------------------------------------------------------------------

    def run_forever(self, stop: threading.Event) -> None:
        """Execute claimed runs until `stop` is set or `request_stop()` is called.

        The thread adds one slot to the process's claimer (agent_runs/worker/claimer.py), which
        claims for every free slot at once, waits for a wake-up (when listening) or the poll
        interval while nothing is claimable, and reconciles expired leases every
        lease_seconds/2. The thread hands each run's end to the writer thread and takes the
        next run; its slot is claimed for again once that end committed. With durable
        completion it returns only once the ends it handed over are written (or given up).
        Database failures are logged and retried with capped exponential back-off; they never
        end the loop.
        """
        loop.run_forever(self, stop)

    def _written(self, count: int) -> None:
        """The writer wrote (or gave up) `count` run_forever threads' ends: their slots come
        back (with durable completion only run_forever threads hand ends over)."""
        self.claimer.give_back(count)

    def slots_to_refill(self, ending: int) -> int:
        """How many runs the writer claims with the ends of `ending` run_forever slots."""
        return self.claimer.refill_wanted(ending)

    def finish_and_claim(
        self, finishes: list[Finish], slots: int
    ) -> tuple[list[datetime | None] | None, int]:
        """The writer's batch of ends and the next runs of up to `slots` of their slots, in one
        transaction (flusher.Refill); the claimed runs go to the claimer's queue."""
        try:
            finished, claimed = claims.finish_and_claim(self, finishes, slots)
        except claims.ClaimNotSent as exc:  # no connection: nothing was sent
            raise exc.error from None
        written = len(claimed) if finished is None else sum(at is not None for at in finished)
        self.claimer.refilled(written, claimed)
        return finished, written

    def release_unstarted(self, claimed: Sequence[Claimed]) -> None:
        """Release for retry runs that were claimed for run_forever threads and never started
        (no thread is left to take them, or the worker stops)."""
        for one in claimed:
            tag = f"run {one.run.id} ({one.lease.worker_id})"
            log.info("%s: no thread left to execute it; releasing", tag)
            try:
                self.completer.finish(one.run, one.lease, RELEASE, tag)
            except Exception:  # the others are still released; this one's lease expires
                log.exception("%s: could not release it", tag)
            finally:
                self.heartbeat.untrack(one.lease)
                self.claimer.give_back()

    def listener(self) -> Wakeups | None:
        """The process's wake-up listener, started by the first claimer that needs it."""
        if self.listen_dsn is None:
            return None
        with self._wakeups_lock:
            if self._wakeups is None and not self.stopping:
                self._wakeups = Wakeups(
                    self.listen_dsn,
                    agent_slugs=self.agent_slugs,
                    connect_kwargs={"connect_timeout": 5},
                )
                self._wakeups.start()
            return self._wakeups

    def maybe_reconcile(self) -> list[AgentRun]:
        """Run `reconcile_expired_leases` if lease_seconds/2 passed since the last time."""
        return self.reconciler.maybe_reconcile()

    def run_once(self, *, stop: threading.Event | None = None) -> AgentRun | None:
        """Claim the next run and execute it; the run as it ended, or None if none was claimable.

        Raises database errors of the claim itself (nothing is held then); failures after the
        claim are handled here under the lease rules. A KeyboardInterrupt raised by the agent is
        re-raised once its fact is written.
        """
        if self.stopping:
            return None
        token = self.new_owner_token()
        # Taken before the claim is sent: the lease cannot start earlier in the database. The
        # batch that carries the claim tells when it was sent, which may be later.
        claimed_at = time.monotonic()
        attempt_no: int | None = None  # known from the claim's own answer
        try:
            claimed, claimed_at = self.claiming.submit(token)
            run, attempt_no = (None, None) if claimed is None else claimed
        except claims.ClaimNotSent as exc:  # no connection: nothing was claimed
            raise exc.error from None
        except DB_ERRORS:
            run = claims.find_claim_in_doubt(self, token, claimed_at)
            if run is None:
                raise
        if run is None:
            return None
        lease = claims.track(self, run, token, claimed_at)
        hand_over = self.completion == "async"
        try:
            if self.telemetry is None:
                return execute(self, run, lease, stop, attempt_no, hand_over=hand_over)
            with self.telemetry.executing(lease.worker_id):
                return execute(self, run, lease, stop, attempt_no, hand_over=hand_over)
        finally:
            if not lease.written_later:
                self.heartbeat.untrack(lease)

    def claim_for_slots(self, count: int) -> list[Claimed]:
        """Claim up to `count` runs in one statement for the claimer (claims.py)."""
        return claims.claim_for_slots(self, count)

    def next_available_in(self) -> float | None:
        """Seconds until a run of ours scheduled for later becomes claimable (None: none)."""
        with self.repository() as repo:
            return repo.next_available_in(agent_slugs=self.agent_slugs)

    def with_lease_retry(
        self, lease: Lease, call: Callable[[AgentRunRepository], T], what: str
    ) -> T:
        """Run `call` with a pooled repository, retrying database failures while the lease holds."""
        backoff = Backoff(cap=max(0.2, self.heartbeat_seconds))
        while True:
            if not lease.provable():
                raise LeaseLost(f"run {lease.run_id}: lease owner {lease.worker_id} lost its lease")
            try:
                with self.repository() as repo:
                    return call(repo)
            except DB_ERRORS as exc:
                delay = backoff.next_delay()
                log.warning(
                    "run %s: could not %s (%s); retrying in %.1fs",
                    lease.run_id,
                    what,
                    one_line(exc),
                    delay,
                )
                time.sleep(delay)
