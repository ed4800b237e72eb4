"""The heartbeat: every lease the process holds, renewed in one statement per round.

A renewal moves a lease's deadline to the moment it was sent plus the lease. A refused renewal
means the lease is lost; a cancel request shows up as the run's status in the renewal's answer.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from psycopg_pool import ConnectionPool, PoolClosed

from agent_runs.backoff import Backoff
from agent_runs.display import one_line
from agent_runs.errors import DB_ERRORS
from agent_runs.logs import logger
from agent_runs.models import RunStatus
from agent_runs.repository import AgentRunRepository
from agent_runs.telemetry.sdk_guard import deferred
from agent_runs.worker.checkout import connection
from agent_runs.worker.lease import Lease

if TYPE_CHECKING:  # telemetry off never imports it
    from agent_runs.telemetry import Telemetry

log = logger("agent_runs.worker")

__all__ = ["HeartbeatService", "Lease"]


class HeartbeatService:
    """One thread that renews every lease of the process in one `renew_leases` call per round."""

    def __init__(
        self,
        pool: ConnectionPool,
        *,
        lease_seconds: float,
        interval: float,
        timeout: float,
        telemetry: Telemetry | None = None,
    ) -> None:
        self._pool = pool
        self._telemetry = telemetry
        self._lease_seconds = lease_seconds
        self._interval = interval
        self._timeout = timeout
        self._leases: dict[str, Lease] = {}  # owner token -> lease
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        self.rounds = 0
        self.failed_rounds = 0

    def track(self, run_id: str, worker_id: str, *, deadline: float) -> Lease:
        """Renew this lease from now on; tracking it again answers the same Lease."""
        with self._lock:
            lease = self._leases.get(worker_id)
            if lease is None or lease.run_id != run_id:
                lease = self._leases[worker_id] = Lease(
                    run_id, worker_id, self._lease_seconds, deadline
                )
            self._start()
        return lease

    def start(self) -> None:
        """Start the heartbeat thread now rather than at the first tracked lease (RuntimeError
        when the system refuses a thread)."""
        with self._lock:
            self._start()

    def _start(self) -> None:
        if self._thread is None and not self._closed.is_set():
            thread = threading.Thread(target=self._loop, name="agent-runs-heartbeat", daemon=True)
            thread.start()  # kept only once started: close() never joins a thread that is not
            self._thread = thread

    def untrack(self, lease: Lease) -> None:
        """The worker is done with this attempt (its end written, or nothing left to write)."""
        with self._lock:
            self._leases.pop(lease.worker_id, None)
        if self._telemetry is not None:  # an attempt span still open: its lease was lost
            self._telemetry.released(lease.worker_id)

    def stop_renewing(self, lease: Lease) -> None:
        lease.heartbeat_stopped = True
        with self._lock:
            self._leases.pop(lease.worker_id, None)

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
                # Retry sooner than a full interval: each failed round eats into the leases, so
                # the closer the earliest of them is to its end, the sooner the next try.
                delay = min(backoff.next_delay(), self._time_to_spare() / 4)

    def _time_to_spare(self) -> float:
        """Seconds until the earliest live lease can no longer be proven (at least 0.2)."""
        now = time.monotonic()
        with self._lock:
            left = [lease.deadline - now for lease in self._leases.values() if lease.provable()]
        return max(0.2, min(left, default=float("inf")))

    def renew_once(self) -> bool:
        """One renewal round over every tracked lease; False when the database could not answer."""
        with self._lock:
            batch: dict[str, Lease] = {}
            for lease in self._leases.values():  # insertion order: a newer claim of a run wins
                if not lease.lost:
                    batch[lease.run_id] = lease
        if not batch:
            return True
        with deferred():  # the renewal's metric once the deadlines below moved
            return self._renew(batch)

    def _renew(self, batch: dict[str, Lease]) -> bool:
        try:
            with connection(self._pool, timeout=self._timeout) as conn:
                # After the checkout (which may wait out an outage), before the renewal is
                # sent: the renewed lease cannot start earlier in the database.
                sent_at = time.monotonic()
                renewed = AgentRunRepository(conn, telemetry=self._telemetry).renew_leases(
                    {run_id: lease.worker_id for run_id, lease in batch.items()},
                    lease_seconds=self._lease_seconds,
                )
        except PoolClosed:
            return False
        except DB_ERRORS as exc:
            self.failed_rounds += 1
            log.warning(
                "heartbeat: could not renew %d lease(s): %s",
                len(batch),
                one_line(exc, with_type=True),
            )
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
