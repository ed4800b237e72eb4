"""The Worker: the parts of the worker, built and wired to each other.

One `Worker` per process. Any number of threads may call `run_once()`/`run_forever()` on it;
they share its pool, its heartbeat thread (one `renew_leases` per round for every lease the
process holds) and its wake-up listener (one LISTEN connection per process). A worker only
writes for a run while it can prove its lease: a refused renewal means the lease is lost (write
nothing), and a lease whose renewals kept failing until its expiry by the worker's own monotonic
clock is dropped (write nothing; the reconciler converges it).

The data flows one way: the claim statements (claims.py) feed the claim source (claimer.py),
whose queue feeds the run_forever threads (loop.py); each thread executes a run (executor.py)
and hands its end to the writer (flusher.py, two threads), which writes it (completer.py) and
gives the slot back to the claim source, claiming the slots' next runs in the same statement.
run_once claims through the same statements and executes in the calling thread (with other
threads' claims and ends when they coincide: batching.py). No part holds the Worker: each is
given the parts and functions it uses, here.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence
from functools import partial
from types import TracebackType
from typing import TYPE_CHECKING

from psycopg_pool import ConnectionPool

from agent_runs import validation as check
from agent_runs.models import AgentRun
from agent_runs.worker.batching import GroupCommit
from agent_runs.worker.checkout import repositories
from agent_runs.worker.claimer import Claimer
from agent_runs.worker.claims import Claiming
from agent_runs.worker.completer import Completer, release_unstarted
from agent_runs.worker.executor import Executor
from agent_runs.worker.flusher import WRITERS, Flusher
from agent_runs.worker.heartbeat import HeartbeatService
from agent_runs.worker.lease import Claimed
from agent_runs.worker.listening import Listener
from agent_runs.worker.loop import SlotThread
from agent_runs.worker.protocol import Agent, LeasedCalls
from agent_runs.worker.reconciler import Reconciler

if TYPE_CHECKING:  # telemetry off never imports it
    from agent_runs.telemetry import Telemetry

# With wake-ups, an idle claimer is woken at once by new runs; the poll only catches what a
# notification could miss (while the listener reconnects), so it can be slow: 10 s keeps an idle
# worker process at about 0.1 claim per second.
LISTENING_POLL_SECONDS = 10.0


class Worker:
    """Claims runs and executes them with `agent`; see agent_runs.worker.outcome for how an
    execution's end is decided and agent_runs.worker.completer for how it is written."""

    # Pooled connections the worker's own threads may hold at once, beside its agents': the
    # claim source, the heartbeat and the writers (the listener opens its own).
    own_connections = 2 + WRITERS

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
        # "async": run_once's ends are written in the background too, and a run_forever slot
        # comes back once its end is handed over, not once it committed.
        self.completion = check.completion(completion)
        durable = self.completion == "durable"
        # How long one database call may wait for a pooled connection (a reconnect included).
        self.connection_timeout = max(1.0, min(5.0, self.lease_seconds / 2))
        retry_cap = max(0.2, self.heartbeat_seconds)
        # OpenTelemetry (agent_runs.telemetry): its repositories record claims, ends and
        # reconciles; the heartbeat, renewals and let-go attempts; None: off.
        self.telemetry = telemetry
        if telemetry is not None:
            telemetry.observe_through(pool)
        self._stopping = threading.Event()
        repository = repositories(pool, timeout=self.connection_timeout, telemetry=telemetry)

        # The parts, each given only what it uses; bottom-up.
        self.heartbeat = HeartbeatService(
            pool,
            lease_seconds=self.lease_seconds,
            interval=self.heartbeat_seconds,
            timeout=self.connection_timeout,
            telemetry=telemetry,
        )
        self.completer = Completer(
            repository,
            lease_seconds=self.lease_seconds,
            retry_cap=retry_cap,
            max_tries=self.max_tries,
        )
        self.claims = Claiming(
            repository,
            self.heartbeat,
            name=self.name,
            lease_seconds=self.lease_seconds,
            retry_cap=retry_cap,
            agent_slugs=self.agent_slugs,
            stopping=self._stopping,
        )
        # run_once threads that claim at the same time share one claim statement.
        self.claiming: GroupCommit[str, Claimed | None] = self.claims.group
        self.reconciler = Reconciler(repository, interval=self.lease_seconds / 2)
        self._listener = Listener(self.listen_dsn, agent_slugs=self.agent_slugs)
        # run_forever threads: one claim source claims for their free slots ...
        self.claimer = Claimer(
            self.claims.for_slots,
            release=partial(release_unstarted, completer=self.completer, heartbeat=self.heartbeat),
            stopping=self._stopping,
            poll_seconds=self.poll_seconds,
            close_timeout=self.lease_seconds + self.connection_timeout,
            reconcile=self.reconciler.maybe_reconcile,
            wakeups=self._listener.wakeups,
            next_available_in=self.claims.next_available_in,
            # durable: a batch of ends claims the next runs in its own transaction
            claim_with_ends=self.claims.with_ends if durable else None,
        )
        # ... and one writer writes their ends (durable: giving their slots back).
        self.flusher = Flusher(
            self.completer,
            self.heartbeat,
            max_batch=check.MAX_BATCH,
            slots=self.claimer if durable else None,
        )
        self.executor = Executor(
            agent,
            completer=self.completer,
            heartbeat=self.heartbeat,
            calls=LeasedCalls(repository, retry_cap=retry_cap),
            hand=self.flusher.hand,
            pool=pool,
            stopping=self._stopping,
            on_agent_exit=partial(_request_stop, self._stopping, self._listener, self.claimer),
            max_tries=self.max_tries,
            async_completion=not durable,
            telemetry=telemetry,
        )

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def stopping(self) -> bool:
        return self._stopping.is_set()

    @property
    def listening(self) -> bool:
        """True while this process's wake-up listener has LISTEN in force."""
        return self._listener.listening

    @property
    def exit_code(self) -> int:
        """0 while all is well; 1 once an agent asked the process to exit."""
        return self.executor.exit_code

    def start_threads(self) -> None:
        """Start the worker's own threads now (heartbeat, writer, wake-up listener) rather than
        at first use, so that a process short of threads fails before it claims anything
        (RuntimeError; close() stops those that started)."""
        self.heartbeat.start()
        self.flusher.start()
        self._listener.wakeups()

    def request_stop(self) -> None:
        """Stop claiming and ask every executing agent to stop (SIGTERM/SIGINT)."""
        _request_stop(self._stopping, self._listener, self.claimer)

    def close(self) -> None:
        """Stop claiming (releasing claimed runs no thread took), write what the writer holds,
        stop the heartbeat thread and the wake-up listener. The pool belongs to the caller."""
        self.claimer.close()
        self.flusher.close()
        self.heartbeat.close()
        self._listener.close()

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
        return self.claims.token()

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
        SlotThread(
            self.claimer,
            stop,
            execute=partial(self.executor.run, hand_over=True),
            wait_written=self.flusher.wait_written,
            stopping=self._stopping,
            async_completion=self.completion == "async",
            linger=self.lease_seconds + self.connection_timeout,
        ).run()

    def run_once(self, *, stop: threading.Event | None = None) -> AgentRun | None:
        """Claim the next run and execute it; the run as it ended, or None if none was claimable.

        Raises database errors of the claim itself (nothing is held then); failures after the
        claim are handled here under the lease rules. A KeyboardInterrupt raised by the agent is
        re-raised once its fact is written.
        """
        if self.stopping:
            return None
        claimed = self.claims.one()
        if claimed is None:
            return None
        return self.executor.run(claimed, stop, hand_over=self.completion == "async")

    def maybe_reconcile(self) -> list[AgentRun]:
        """Run `reconcile_expired_leases` if lease_seconds/2 passed since the last time."""
        return self.reconciler.maybe_reconcile()


def _request_stop(stopping: threading.Event, listener: Listener, claimer: Claimer) -> None:
    """Stop claiming and ask every executing agent to stop: the stop event first, then whoever
    waits for a wake-up or for a claimed run is woken to see it."""
    stopping.set()
    listener.interrupt()
    claimer.interrupt()
