"""Synchronous worker runtime: claim a run, execute an agent, heartbeat the lease, record the end.

One `Worker` per process. Any number of threads may call `run_once()`/`run_forever()` on it; they
share its pool and its single heartbeat thread, which renews every lease the process holds in one
`renew_leases` statement. A worker only writes for a run while it can prove its lease: a refused
renewal means the lease is lost (write nothing), and a lease whose renewals kept failing until its
expiry by the worker's own monotonic clock is dropped (write nothing; the reconciler converges it).
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, TypeVar

import psycopg
from psycopg_pool import ConnectionPool, PoolClosed, PoolTimeout

from agent_runs.errors import InvalidArgument, NotLeaseOwner
from agent_runs.models import AgentRun, AttemptOutcome, RunStatus, manifest_fingerprint
from agent_runs.repository import AgentRunRepository

log = logging.getLogger("agent_runs.worker")

# Failures of the database or of the way to it: the worker logs them, backs off and reconnects.
# (PoolTimeout and TooManyRequests are OperationalErrors; PoolClosed is handled apart.)
DB_ERRORS: Final = (psycopg.OperationalError, psycopg.InterfaceError)

# How long a checkout waits for the pool before connecting directly (see `connection`).
POOL_WAIT_SECONDS: Final = 0.5

# Owner tokens are `f"{name}:{uuid4().hex}"` and worker_id is at most 128 characters.
MAX_NAME_LENGTH: Final = 128 - 33


@contextmanager
def connection(pool: ConnectionPool, *, timeout: float) -> Iterator[psycopg.Connection[Any]]:
    """A pooled connection or, while the pool is still backing off after an outage, a direct one.

    psycopg_pool waits 1, 2, 4 … seconds between reconnection attempts: after a server restart
    it can keep failing checkouts for seconds while the server is already back, and a lease
    would expire meanwhile. A direct connection answers as soon as the server does.
    """
    try:
        # A healthy pool answers at once; waiting longer only waits out its back-off.
        conn = pool.getconn(timeout=min(timeout, POOL_WAIT_SECONDS))
    except PoolTimeout:
        conninfo = pool.conninfo() if callable(pool.conninfo) else pool.conninfo
        kwargs = (pool.kwargs() if callable(pool.kwargs) else pool.kwargs) or {}
        direct = psycopg.connect(conninfo, **{**kwargs, "autocommit": True, "connect_timeout": 2})
        with direct:
            yield direct
        return
    try:
        yield conn
    finally:
        pool.putconn(conn)


class RetryableError(Exception):
    """Raised by an agent for a transient failure: the run is released for another attempt."""


class LeaseLost(NotLeaseOwner):
    """The worker can no longer prove it holds the run's lease; the agent should stop."""


@dataclass(frozen=True, slots=True)
class AgentResult:
    """How an agent's execution ended; build it with one of the class methods."""

    status: RunStatus
    error_type: str | None = None
    error_message: str | None = None

    @classmethod
    def completed(cls) -> AgentResult:
        return cls(RunStatus.COMPLETED)

    @classmethod
    def failed(cls, error_type: str, message: str) -> AgentResult:
        return cls(RunStatus.FAILED, error_type, message)

    @classmethod
    def interrupted(cls, error_type: str, message: str) -> AgentResult:
        return cls(RunStatus.INTERRUPTED, error_type, message)


class Backoff:
    """Capped exponential back-off with jitter, for retries against an unavailable database."""

    def __init__(self, *, initial: float = 0.1, cap: float = 5.0) -> None:
        self.initial = initial
        self.cap = cap
        self.failures = 0

    def next_delay(self) -> float:
        delay = min(self.cap, self.initial * 2.0 ** min(self.failures, 30))
        self.failures += 1
        return delay * random.uniform(0.5, 1.0)

    def reset(self) -> None:
        self.failures = 0


class _Lease:
    """What this process knows about one lease it holds; written by the heartbeat thread."""

    def __init__(self, run_id: str, worker_id: str, lease_seconds: float, deadline: float) -> None:
        self.run_id = run_id
        self.worker_id = worker_id
        self.lease_seconds = lease_seconds
        # Monotonic time until which the lease is proven live: the moment a successful claim or
        # renewal was *sent* plus the lease, so it never outlives the database's own expiry.
        self.deadline = deadline
        self.lost = False  # a renewal was refused: someone else decides this run's fate now
        self.cancel_requested = False
        self.heartbeat_stopped = False  # the agent opted out (ctx.stop_heartbeat)
        self.finishing = False  # the final write is under way: a refusal may be our own write

    def expired(self) -> bool:
        return time.monotonic() >= self.deadline

    def provable(self) -> bool:
        return not self.lost and not self.expired()


class HeartbeatService:
    """One thread that renews every lease of the process in one `renew_leases` call per round."""

    def __init__(
        self, pool: ConnectionPool, *, lease_seconds: float, interval: float, timeout: float
    ) -> None:
        self._pool = pool
        self._lease_seconds = lease_seconds
        self._interval = interval
        self._timeout = timeout
        self._leases: dict[str, _Lease] = {}  # owner token -> lease
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.rounds = 0
        self.failed_rounds = 0

    def track(self, run_id: str, worker_id: str, *, deadline: float) -> _Lease:
        lease = _Lease(run_id, worker_id, self._lease_seconds, deadline)
        with self._lock:
            self._leases[worker_id] = lease
            if self._thread is None and not self._closed.is_set():
                self._thread = threading.Thread(
                    target=self._loop, name="agent-runs-heartbeat", daemon=True
                )
                self._thread.start()
        return lease

    def untrack(self, lease: _Lease) -> None:
        with self._lock:
            self._leases.pop(lease.worker_id, None)

    def stop_renewing(self, lease: _Lease) -> None:
        lease.heartbeat_stopped = True
        self.untrack(lease)

    def close(self) -> None:
        self._closed.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._timeout + 1.0)

    def _loop(self) -> None:
        backoff = Backoff(initial=0.2, cap=self._interval)
        delay = self._interval
        while not self._closed.wait(delay):
            try:
                ok = self.renew_once()
            except Exception:  # never let the heartbeat thread die
                log.exception("heartbeat round failed unexpectedly")
                ok = False
            if ok:
                backoff.reset()
                delay = self._interval
            else:
                # Retry sooner than a full interval: each failed round eats into the leases.
                delay = backoff.next_delay()

    def renew_once(self) -> bool:
        """One renewal round over every tracked lease; False when the database could not answer."""
        with self._lock:
            batch: dict[str, _Lease] = {}
            for lease in self._leases.values():  # insertion order: a newer claim of a run wins
                if not lease.lost:
                    batch[lease.run_id] = lease
        if not batch:
            return True
        try:
            with connection(self._pool, timeout=self._timeout) as conn:
                # After the checkout (which may wait out an outage), before the renewal is
                # sent: the renewed lease cannot start earlier in the database.
                sent_at = time.monotonic()
                renewed = AgentRunRepository(conn).renew_leases(
                    {run_id: lease.worker_id for run_id, lease in batch.items()},
                    lease_seconds=self._lease_seconds,
                )
        except PoolClosed:
            return False
        except DB_ERRORS as exc:
            self.failed_rounds += 1
            log.warning("heartbeat: could not renew %d lease(s): %s", len(batch), _one_line(exc))
            return False
        self.rounds += 1
        for run_id, lease in batch.items():
            status = renewed.get(run_id)
            if status is None:
                if not lease.lost and not lease.finishing:
                    log.warning(
                        "run %s: lease of %s was refused: lost; writing nothing more for it",
                        run_id,
                        lease.worker_id,
                    )
                lease.lost = True
            else:
                lease.deadline = max(lease.deadline, sent_at + self._lease_seconds)
                if status == RunStatus.CANCEL_REQUESTED:
                    lease.cancel_requested = True
        return True


class RunContext:
    """What an executing agent sees of its run: identity, stop requests, manifest recording."""

    def __init__(
        self,
        worker: Worker,
        run: AgentRun,
        lease: _Lease,
        attempt_no: int,
        stop: threading.Event | None,
    ) -> None:
        self._worker = worker
        self._lease = lease
        self._stop = stop
        self.run_id = run.id
        self.attempt_no = attempt_no
        self.worker_id = lease.worker_id
        self.lease_seconds = lease.lease_seconds

    def stop_reason(self) -> str | None:
        """Why the agent should stop (`cancel_requested`, `lease_lost`, `shutdown`), or None."""
        if self._lease.cancel_requested:
            return "cancel_requested"
        if self._lease.lost or self._lease.expired():
            return "lease_lost"
        if self._worker.stopping or (self._stop is not None and self._stop.is_set()):
            return "shutdown"
        return None

    def should_stop(self) -> bool:
        """True once the run is cancelled, its lease is lost, or the worker is shutting down."""
        return self.stop_reason() is not None

    def wait(self, seconds: float, *, tick: float = 0.05) -> bool:
        """Sleep up to `seconds`, waking early when the agent should stop; True if it should."""
        end = time.monotonic() + seconds
        while not self.should_stop():
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(tick, left))
        return True

    def stop_heartbeat(self) -> None:
        """Stop renewing this run's lease (it then expires); the worker no longer vouches for it."""
        self._worker.heartbeat.stop_renewing(self._lease)

    def record_manifest(self, manifest: dict[str, Any]) -> bool:
        """Record the run's write-once manifest; False if one was already recorded.

        Raises NotLeaseOwner when the repository refuses (the run is not ours, or not running)
        and LeaseLost when the database stays unreachable until the lease can no longer be proven.
        """
        fingerprint = manifest_fingerprint(manifest)

        def write(repo: AgentRunRepository) -> bool:
            return repo.record_run_manifest(
                self.run_id, manifest=manifest, fingerprint=fingerprint, worker_id=self.worker_id
            ).changed

        return self._worker.with_lease_retry(self._lease, write, "record the manifest")


# The agent protocol: `agent(run, ctx) -> AgentResult`, run in the thread that claimed the run.
Agent = Callable[[AgentRun, RunContext], AgentResult]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Decision:
    """What the worker will write for a run once its agent has returned."""

    status: RunStatus | None  # None: release for retry
    error_type: str | None = None
    error_message: str | None = None


class Worker:
    """Claims runs and executes them with `agent` (SPEC section 4).

    How an execution ends, in order: lease lost or unprovable -> nothing written; cancel
    requested -> `cancelled`; worker stopping -> released for retry unless the agent returned
    `completed`; RetryableError -> released while attempt_no < max_tries, else `failed` /
    `retries_exhausted`; other exception -> `failed` / `agent_error`; else the AgentResult.
    """

    def __init__(
        self,
        pool: ConnectionPool,
        agent: Agent,
        *,
        name: str | None = None,
        lease_seconds: float = 60,
        heartbeat_seconds: float | None = None,
        max_tries: int = 3,
        poll_seconds: float = 1.0,
        agent_slugs: list[str] | None = None,
    ) -> None:
        if name is None:
            name = f"{socket.gethostname()}-{os.getpid()}"[:MAX_NAME_LENGTH]
        if not name or len(name) > MAX_NAME_LENGTH or "\x00" in name:
            raise InvalidArgument(f"name must be 1-{MAX_NAME_LENGTH} characters without NUL")
        if not _positive(lease_seconds) or lease_seconds > 86400:
            raise InvalidArgument("lease_seconds must be a finite number, 0 < x <= 86400")
        if heartbeat_seconds is None:
            heartbeat_seconds = lease_seconds / 3
        if not _positive(heartbeat_seconds) or heartbeat_seconds >= lease_seconds:
            raise InvalidArgument("heartbeat_seconds must be > 0 and shorter than lease_seconds")
        if isinstance(max_tries, bool) or not isinstance(max_tries, int) or max_tries < 1:
            raise InvalidArgument("max_tries must be an integer >= 1")
        if not (_positive(poll_seconds) or poll_seconds == 0):
            raise InvalidArgument("poll_seconds must be a finite number >= 0")
        self.pool = pool
        self.agent = agent
        self.name = name
        self.lease_seconds = float(lease_seconds)
        self.heartbeat_seconds = float(heartbeat_seconds)
        self.max_tries = max_tries
        self.poll_seconds = float(poll_seconds)
        self.agent_slugs = list(agent_slugs) if agent_slugs else None
        # How long one database call may wait for a pooled connection (a reconnect included).
        self.connection_timeout = max(1.0, min(5.0, self.lease_seconds / 2))
        self.heartbeat = HeartbeatService(
            pool,
            lease_seconds=self.lease_seconds,
            interval=self.heartbeat_seconds,
            timeout=self.connection_timeout,
        )
        self._stopping = threading.Event()
        self._reconcile_lock = threading.Lock()
        self._next_reconcile = 0.0

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    def request_stop(self) -> None:
        """Stop claiming and ask every executing agent to stop (SIGTERM/SIGINT)."""
        self._stopping.set()

    def close(self) -> None:
        """Stop the heartbeat thread. The pool belongs to the caller."""
        self.heartbeat.close()

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
        """Claim and execute runs until `stop` is set or `request_stop()` is called.

        Reconciles expired leases every lease_seconds/2 (one thread per worker does it). Database
        failures are logged and retried with capped exponential back-off; they never end the loop.
        """
        backoff = Backoff()
        while not (stop.is_set() or self.stopping):
            try:
                self.maybe_reconcile()
                run = self.run_once(stop=stop)
            except PoolClosed:
                log.info("pool closed; worker loop ends")
                return
            except DB_ERRORS as exc:
                delay = backoff.next_delay()
                log.warning("database unavailable (%s); retrying in %.1fs", _one_line(exc), delay)
                stop.wait(delay)
                continue
            except Exception:  # a bug must not end a long-lived worker; it is logged loudly
                delay = backoff.next_delay()
                log.exception("worker loop error; retrying in %.1fs", delay)
                stop.wait(delay)
                continue
            backoff.reset()
            if run is None:
                stop.wait(self.poll_seconds)

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
        except DB_ERRORS as exc:
            log.warning("reconcile skipped: %s", _one_line(exc))
            return []
        for run in converged:
            log.info("reconciled run %s: lease expired, now %s", run.id, run.status)
        return converged

    def run_once(self, *, stop: threading.Event | None = None) -> AgentRun | None:
        """Claim the next run and execute it; the run as it ended, or None if none was claimable.

        Raises database errors of the claim itself (nothing is held then); failures after the
        claim are handled here under the lease rules.
        """
        if self.stopping:
            return None
        token = self.new_owner_token()
        claimed_at: float | None = None
        try:
            with self.repository() as repo:
                # Taken after the checkout (which may wait out an outage) and before the claim
                # is sent: the lease cannot start earlier in the database. Conservative.
                claimed_at = time.monotonic()
                run = repo.claim_next(
                    worker_id=token, lease_seconds=self.lease_seconds, agent_slugs=self.agent_slugs
                )
        except DB_ERRORS:
            if claimed_at is None:  # no connection: the claim was never sent
                raise
            # The claim may have committed although its reply was lost: find it by our token
            # while its lease can still be live, rather than leave it to expire unexecuted.
            run = self._find_claim_in_doubt(token, deadline=claimed_at + self.lease_seconds)
            if run is None:
                raise
            log.warning("run %s: claim reply was lost; found it by its owner token", run.id)
        if run is None:
            return None
        lease = self.heartbeat.track(run.id, token, deadline=claimed_at + self.lease_seconds)
        try:
            return self._execute(run, lease, stop)
        finally:
            self.heartbeat.untrack(lease)

    def _find_claim_in_doubt(self, token: str, *, deadline: float) -> AgentRun | None:
        backoff = Backoff(cap=max(0.2, self.heartbeat_seconds))
        while time.monotonic() < deadline:
            try:
                with self.repository() as repo:
                    return repo.get_run_by_owner(token)
            except DB_ERRORS:
                time.sleep(min(backoff.next_delay(), max(0.0, deadline - time.monotonic())))
        return None

    # -- one run ---------------------------------------------------------------------------

    def _execute(self, run: AgentRun, lease: _Lease, stop: threading.Event | None) -> AgentRun:
        tag = f"run {run.id} ({lease.worker_id})"
        try:
            attempt_no = self.with_lease_retry(lease, self._own_attempt_no(run.id, lease), "read")
        except LeaseLost:
            log.warning("%s: lease lost before the agent started; writing nothing", tag)
            return self._reread(run)
        if attempt_no is None:
            lease.lost = True
            log.warning("%s: no open attempt of ours after the claim; writing nothing", tag)
            return self._reread(run)
        tag = f"run {run.id} attempt {attempt_no} ({lease.worker_id})"

        if run.status == RunStatus.CANCEL_REQUESTED:
            log.info("%s: claimed with a cancel request; finishing cancelled", tag)
            return self._write(run, lease, _Decision(RunStatus.CANCELLED), tag)

        ctx = RunContext(self, run, lease, attempt_no, stop)
        if ctx.stop_reason() == "shutdown":  # stopped between the claim and the start
            log.info("%s: shutting down before the agent started; releasing", tag)
            return self._write(run, lease, _Decision(None), tag)
        log.info("%s: started (agent slug %s)", tag, run.agent_slug)
        retry: RetryableError | None = None
        result: AgentResult | None = None
        try:
            result = self.agent(run, ctx)
        except RetryableError as exc:
            retry = exc
        except KeyboardInterrupt:
            if lease.provable():
                self._write(run, lease, _Decision(None), tag)
            raise
        except Exception as exc:
            result = AgentResult.failed("agent_error", _exception_text(exc))
        else:
            if not isinstance(result, AgentResult):
                result = AgentResult.failed(
                    "agent_error", f"agent returned {type(result).__name__}, not AgentResult"
                )

        if lease.lost:
            log.warning("%s: lease lost during execution; writing nothing", tag)
            return self._reread(run)
        if lease.expired() and not lease.heartbeat_stopped:
            log.warning("%s: lease could not be proven until its expiry; dropping the run", tag)
            return self._reread(run)
        decision = self._decide(ctx, attempt_no, result, retry)
        return self._write(run, lease, decision, tag)

    def _decide(
        self,
        ctx: RunContext,
        attempt_no: int,
        result: AgentResult | None,
        retry: RetryableError | None,
    ) -> _Decision:
        reason = ctx.stop_reason()
        if reason == "cancel_requested":
            return _Decision(RunStatus.CANCELLED)
        if reason == "shutdown" and (result is None or result.status != RunStatus.COMPLETED):
            # The agent was asked to stop: let another worker run it again.
            return _Decision(None)
        if retry is not None:
            if attempt_no < self.max_tries:
                return _Decision(None)
            return _Decision(
                RunStatus.FAILED,
                "retries_exhausted",
                f"attempt {attempt_no} of {self.max_tries} failed with a retryable error: "
                f"{_exception_text(retry)}",
            )
        assert result is not None
        return _Decision(result.status, result.error_type, result.error_message)

    def _own_attempt_no(
        self, run_id: str, lease: _Lease
    ) -> Callable[[AgentRunRepository], int | None]:
        def read(repo: AgentRunRepository) -> int | None:
            attempt = repo.get_open_attempt(run_id)
            if attempt is None or attempt.worker_id != lease.worker_id:
                return None
            return attempt.attempt_no

        return read

    def _write(self, run: AgentRun, lease: _Lease, decision: _Decision, tag: str) -> AgentRun:
        """Write the decision under the repository lease guard; handle refusals, lost replies."""
        lease.finishing = True
        in_doubt = False  # a previous try may have committed although its reply was lost
        backoff = Backoff(cap=max(0.2, self.heartbeat_seconds))
        give_up_at = time.monotonic() + self.lease_seconds  # only used once the heartbeat stopped
        while True:
            if in_doubt:
                done = self._confirm(run.id, lease, decision)
                if done is not None:
                    log.info("%s: %s (confirmed after a lost reply)", tag, done.status)
                    return done
            if lease.lost:
                log.warning("%s: lease lost; writing nothing", tag)
                return self._reread(run)
            if lease.heartbeat_stopped:
                if time.monotonic() >= give_up_at:
                    log.warning("%s: database unreachable; result dropped", tag)
                    return run
            elif lease.expired():
                log.warning("%s: lease could not be proven until its expiry; dropping", tag)
                return self._reread(run)
            try:
                with self.repository() as repo:
                    if decision.status is None:
                        if repo.release_lease_for_retry(run.id, worker_id=lease.worker_id):
                            log.info("%s: released for retry", tag)
                            return repo.get_run(run.id) or run
                        current = repo.get_run(run.id)
                    else:
                        transition = repo.set_terminal_status(
                            run.id,
                            status=decision.status,
                            worker_id=lease.worker_id,
                            error_type=decision.error_type,
                            error_message=decision.error_message,
                        )
                        if transition.run is not None and transition.changed:
                            log.info("%s: %s%s", tag, decision.status, _error_suffix(decision))
                            return transition.run
                        current = transition.run
            except PoolClosed:
                log.warning("%s: pool closed before the result was written", tag)
                return run
            except DB_ERRORS as exc:
                in_doubt = True
                delay = backoff.next_delay()
                log.warning(
                    "%s: could not write %s (%s); retrying in %.1fs",
                    tag,
                    decision.status or "retry release",
                    _one_line(exc),
                    delay,
                )
                time.sleep(delay)
                continue

            # Refused: the database answered. Perhaps to our own earlier write whose reply was lost.
            if in_doubt:
                done = self._confirm(run.id, lease, decision)
                if done is not None:
                    log.info("%s: %s (confirmed after a lost reply)", tag, done.status)
                    return done
                in_doubt = False
            # A cancel request that arrived after the last heartbeat: finish cancelled.
            if (
                current is not None
                and current.status == RunStatus.CANCEL_REQUESTED
                and current.worker_id == lease.worker_id
                and decision.status != RunStatus.CANCELLED
            ):
                decision = _Decision(RunStatus.CANCELLED)
                continue
            lease.lost = True
            log.warning(
                "%s: the repository refused %s (lease no longer ours; run is %s)",
                tag,
                decision.status or "the retry release",
                current.status if current is not None else "gone",
            )
            return current or run

    def _confirm(self, run_id: str, lease: _Lease, decision: _Decision) -> AgentRun | None:
        """After a lost reply: the run if our attempt already finished as decided (a read)."""
        expected = (
            AttemptOutcome.RETRY_RELEASED
            if decision.status is None
            else AttemptOutcome(decision.status.value)
        )
        try:
            with self.repository() as repo:
                for attempt in repo.list_run_attempts(run_id):
                    if attempt.worker_id == lease.worker_id and attempt.outcome == expected:
                        return repo.get_run(run_id)
        except DB_ERRORS:
            pass
        return None

    def with_lease_retry(
        self, lease: _Lease, call: Callable[[AgentRunRepository], T], what: str
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
                    _one_line(exc),
                    delay,
                )
                time.sleep(delay)

    def _reread(self, run: AgentRun) -> AgentRun:
        """The run as the database has it now (a read, never a write); the snapshot on failure."""
        try:
            with self.repository() as repo:
                return repo.get_run(run.id) or run
        except DB_ERRORS:
            return run


def _positive(value: float) -> bool:
    return (
        isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
        and value > 0
    )


def _exception_text(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _one_line(exc: BaseException) -> str:
    return " ".join(_exception_text(exc).split())


def _error_suffix(decision: _Decision) -> str:
    return f" ({decision.error_type}: {decision.error_message})" if decision.error_type else ""
