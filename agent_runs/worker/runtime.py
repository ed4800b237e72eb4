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

The claims (with their lost-reply recovery) and one execution read best together; the decision
and the writing live in outcome.py and completer.py.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from types import TracebackType
from typing import TypeVar

from psycopg_pool import ConnectionPool, PoolClosed

from agent_runs import validation as check
from agent_runs.backoff import Backoff
from agent_runs.errors import DB_ERRORS, LeaseLost
from agent_runs.logs import logger
from agent_runs.models import AgentRun, ClaimedRun, RunStatus
from agent_runs.notify import Wakeups
from agent_runs.repository import AgentRunRepository
from agent_runs.worker.batching import GroupCommit
from agent_runs.worker.claimer import WAIT_SLICE_SECONDS, Claimed, Claimer, Slot
from agent_runs.worker.completer import Completer, run_as_written
from agent_runs.worker.connection import connection
from agent_runs.worker.flusher import Flusher
from agent_runs.worker.heartbeat import HeartbeatService, Lease
from agent_runs.worker.outcome import CANCELLED, RELEASE, Decision, Ending, decide
from agent_runs.worker.protocol import Agent, RunContext
from agent_runs.worker.text import one_line

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
        self.heartbeat = HeartbeatService(
            pool,
            lease_seconds=self.lease_seconds,
            interval=self.heartbeat_seconds,
            timeout=self.connection_timeout,
        )
        self.completer = Completer(
            self.repository,
            lease_seconds=self.lease_seconds,
            retry_cap=max(0.2, self.heartbeat_seconds),
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
        )
        # run_once threads that claim at the same time share one claim statement.
        self.claiming = GroupCommit(self._claim_batch, max_batch=check.MAX_BATCH)
        # 0 while all is well; non-zero once an agent asked the process to exit.
        self.exit_code = 0
        self._stopping = threading.Event()
        self._reconcile_lock = threading.Lock()
        self._next_reconcile = 0.0
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
            yield AgentRunRepository(conn)

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
        slot = self.claimer.join(stop)
        handed: list[Lease] = []  # the last run whose end this thread handed over
        try:
            self._execute_claimed(slot, handed)
        finally:
            self.release_unstarted(self.claimer.leave(slot))
            if handed and self.completion == "durable":
                self.flusher.wait_written(
                    handed[0], timeout=self.lease_seconds + self.connection_timeout
                )

    def _execute_claimed(self, slot: Slot, handed: list[Lease]) -> None:
        stop = slot.stop
        backoff = Backoff()
        while not (stop.is_set() or self.stopping):
            claimed = self.claimer.take(WAIT_SLICE_SECONDS)
            if claimed is None:
                if self.claimer.pool_closed:
                    log.info("pool closed; worker loop ends")
                    return
                continue
            if stop.is_set() and not self.stopping:
                # Only this thread stops: the run is for an idle thread that goes on, or
                # released unstarted; either way it spends no attempt here.
                if not self.claimer.put_back(claimed):
                    self.release_unstarted([claimed])
                return
            slot.busy = True
            try:
                self._run_claimed(claimed, stop, handed)
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

    def _run_claimed(self, claimed: Claimed, stop: threading.Event, handed: list[Lease]) -> None:
        lease = claimed.lease
        try:
            self._execute(claimed.run, lease, stop, claimed.attempt_no, hand_over=True)
        finally:
            if not lease.written_later:
                self.heartbeat.untrack(lease)
                self.claimer.give_back()
            else:
                handed[:] = [lease]
                if self.completion == "async":
                    self.claimer.give_back()  # done once handed over; durable: once written

    def _written(self, count: int) -> None:
        """The writer wrote (or gave up) `count` run_forever threads' ends: their slots come
        back (with durable completion only run_forever threads hand ends over)."""
        self.claimer.give_back(count)

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
        with self._reconcile_lock:
            now = time.monotonic()
            if now < self._next_reconcile:
                return []
            self._next_reconcile = now + self.lease_seconds / 2
        try:
            with self.repository() as repo:
                converged = repo.reconcile_expired_leases()
        except PoolClosed:
            raise  # the caller's loop ends
        except DB_ERRORS as exc:
            log.warning("reconcile skipped: %s", one_line(exc))
            return []
        for run in converged:
            log.info("reconciled run %s: lease expired, now %s", run.id, run.status)
        return converged

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
        except _ClaimNotSent as exc:  # no connection: nothing was claimed
            raise exc.error from None
        except DB_ERRORS:
            run = self._find_claim_in_doubt(token, claimed_at)
            if run is None:
                raise
        if run is None:
            return None
        lease = self._track(run, token, claimed_at)
        try:
            return self._execute(run, lease, stop, attempt_no, hand_over=self.completion == "async")
        finally:
            if not lease.written_later:
                self.heartbeat.untrack(lease)

    def claim_for_slots(self, count: int) -> list[Claimed]:
        """Claim up to `count` runs in one statement for the claimer, each under its own lease.

        Raises database errors of the claim itself when nothing can have been claimed; after a
        lost reply, the runs are found by their owner tokens (as run_once does)."""
        tokens = [self.new_owner_token() for _ in range(count)]
        claimed_at = time.monotonic()  # as in run_once: no lease starts earlier in the database
        try:
            answers = self._claim_batch(tokens)
        except _ClaimNotSent as exc:
            raise exc.error from None
        except DB_ERRORS:
            found = [
                (token, run)
                for token in tokens
                if (run := self._find_claim_in_doubt(token, claimed_at)) is not None
            ]
            if not found:
                raise
            return [Claimed(run, self._track(run, token, claimed_at), None) for token, run in found]
        return [
            Claimed(one.run, self._track(one.run, token, sent_at), one.attempt_no)
            for token, (one, sent_at) in zip(tokens, answers, strict=True)
            if one is not None
        ]

    def _track(self, run: AgentRun, token: str, sent_at: float) -> Lease:
        return self.heartbeat.track(run.id, token, deadline=sent_at + self.lease_seconds)

    def _claim_batch(self, tokens: list[str]) -> list[tuple[ClaimedRun | None, float]]:
        """One claim statement for every claimer thread waiting now: a run each, oldest first,
        with the moment the statement was sent (after the checkout, which may wait out an
        outage: no lease of the batch starts earlier in the database)."""
        if self.stopping:  # a stop request arrived while these claimers waited: claim nothing
            return [(None, time.monotonic())] * len(tokens)
        with ExitStack() as checkout:
            try:
                repo = checkout.enter_context(self.repository())
            except DB_ERRORS as exc:
                raise _ClaimNotSent(exc) from exc
            sent_at = time.monotonic()
            if len(tokens) == 1:  # a lone claimer: claim_next's own statement (LIMIT 1)
                one = repo.claim_next_attempt(
                    worker_id=tokens[0],
                    lease_seconds=self.lease_seconds,
                    agent_slugs=self.agent_slugs,
                )
                return [(one, sent_at)]
            claimed = repo.claim_next_attempts(
                worker_ids=tokens, lease_seconds=self.lease_seconds, agent_slugs=self.agent_slugs
            )
        by_owner = {c.run.worker_id: c for c in claimed}
        return [(by_owner.get(token), sent_at) for token in tokens]

    def _find_claim_in_doubt(self, token: str, claimed_at: float) -> AgentRun | None:
        """A claim whose reply was lost may have committed: find it by its owner token while
        its lease can still be live, rather than leave it to expire unexecuted."""
        deadline = claimed_at + self.lease_seconds
        backoff = Backoff(cap=max(0.2, self.heartbeat_seconds))
        while time.monotonic() < deadline:
            try:
                with self.repository() as repo:
                    run = repo.get_run_by_owner(token)
            except DB_ERRORS:
                time.sleep(min(backoff.next_delay(), max(0.0, deadline - time.monotonic())))
                continue
            if run is not None:
                log.warning("run %s: claim reply was lost; found it by its owner token", run.id)
            return run
        return None

    # -- one run ---------------------------------------------------------------------------

    def _execute(
        self,
        run: AgentRun,
        lease: Lease,
        stop: threading.Event | None,
        attempt_no: int | None,
        *,
        hand_over: bool,
    ) -> AgentRun:
        """Execute the agent and have the end written: here, or (`hand_over`) by the writer."""
        tag = f"run {run.id} ({lease.worker_id})"
        if attempt_no is None:  # a claim found after its reply was lost: read our attempt
            try:
                attempt_no = self.with_lease_retry(lease, _own_attempt_no(run.id, lease), "read")
            except LeaseLost:
                log.warning("%s: lease lost before the agent started; writing nothing", tag)
                return self.completer.reread(run)
        if attempt_no is None:
            lease.lost = True
            log.warning("%s: no open attempt of ours after the claim; writing nothing", tag)
            return self.completer.reread(run)
        tag = f"run {run.id} attempt {attempt_no} ({lease.worker_id})"

        if run.status == RunStatus.CANCEL_REQUESTED:
            log.info("%s: claimed with a cancel request; finishing cancelled", tag)
            return self.completer.finish(run, lease, CANCELLED, tag)

        ctx = RunContext(self, run, lease, attempt_no, stop)
        # What happened between the claim and the start (a claimed run may wait for a thread).
        before_start = ctx.stop_reason()
        if before_start == "cancel_requested":
            log.info("%s: cancel requested before the agent started; finishing cancelled", tag)
            return self.completer.finish(run, lease, CANCELLED, tag)
        if before_start == "lease_lost":
            log.warning("%s: lease lost before the agent started; writing nothing", tag)
            return self.completer.reread(run)
        if before_start == "shutdown":
            log.info("%s: shutting down before the agent started; releasing", tag)
            return self.completer.finish(run, lease, RELEASE, tag)
        log.debug("%s: started (agent slug %s)", tag, run.agent_slug)
        ending = _call(self.agent, run, ctx)
        if ending.stops_worker:
            self.exit_code = 1
            self.request_stop()
            log.error(
                "%s: the agent raised %s; the worker stops", tag, type(ending.raised).__name__
            )

        if lease.lost:
            log.warning("%s: lease lost during execution; writing nothing", tag)
            ended = self.completer.reread(run)
        elif lease.expired() and not lease.heartbeat_stopped:
            log.warning("%s: lease could not be proven until its expiry; dropping the run", tag)
            ended = self.completer.reread(run)
        else:
            decision = decide(
                ending,
                stop_reason=ctx.stop_reason(),
                attempt_no=attempt_no,
                max_tries=self.max_tries,
            )
            # An agent that stops the process has its end written before the exception goes on
            # (with async completion only once the writer closes).
            hand_over = hand_over and (self.completion == "async" or not ending.stops_worker)
            ended = self._finish(ctx.run, lease, decision, tag, hand_over=hand_over)
        if isinstance(ending.raised, KeyboardInterrupt):
            raise ending.raised
        return ended

    def _finish(
        self, run: AgentRun, lease: Lease, decision: Decision, tag: str, *, hand_over: bool
    ) -> AgentRun:
        """Write the end now, or (`hand_over`) hand it to the writer thread and return the run
        as it will be written, finished_at not yet known."""
        flusher = self.flusher
        if (
            not hand_over
            or decision.releases
            or not lease.provable()
            or lease.heartbeat_stopped
            or not flusher.hand(run, lease, decision, tag)
        ):
            return self.completer.finish(run, lease, decision, tag)
        log.debug("%s: %s, handed to the flusher", tag, decision.status)
        return run_as_written(run, decision, None)

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


class _ClaimNotSent(Exception):
    """No connection for a batch of claims: nothing was sent, so nothing can be in doubt."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _call(agent: Agent, run: AgentRun, ctx: RunContext) -> Ending:
    """Run the agent; whatever it returns or raises becomes an Ending (nothing escapes)."""
    try:
        return Ending(returned=agent(run, ctx))
    except BaseException as exc:  # every way an agent can end is a fact to record
        return Ending(raised=exc)


def _own_attempt_no(run_id: str, lease: Lease) -> Callable[[AgentRunRepository], int | None]:
    def read(repo: AgentRunRepository) -> int | None:
        attempt = repo.get_open_attempt(run_id)
        if attempt is None or attempt.worker_id != lease.worker_id:
            return None
        return attempt.attempt_no

    return read
