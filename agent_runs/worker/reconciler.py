"""The reconcile pass: converge runs whose leases expired, at most every lease_seconds/2 per
process, whichever thread (a claimer's, a caller's) asks first."""

from __future__ import annotations

import threading
import time

from psycopg_pool import PoolClosed

from agent_runs.display import one_line
from agent_runs.errors import DB_ERRORS
from agent_runs.logs import logger
from agent_runs.models import AgentRun
from agent_runs.worker.checkout import Repositories

log = logger("agent_runs.worker")


class Reconciler:
    """Runs `reconcile_expired_leases` with a pooled repository, no more often than `interval`."""

    def __init__(
        self,
        repository: Repositories,
        *,
        interval: float,
    ) -> None:
        self._repository = repository
        self._interval = interval
        self._reconcile_lock = threading.Lock()
        self._next_reconcile = 0.0

    def maybe_reconcile(self) -> list[AgentRun]:
        """Run `reconcile_expired_leases` if `interval` passed since the last time."""
        with self._reconcile_lock:
            now = time.monotonic()
            if now < self._next_reconcile:
                return []
            self._next_reconcile = now + self._interval
        try:
            with self._repository() as repo:
                converged = repo.reconcile_expired_leases()
        except PoolClosed:
            raise  # the caller's loop ends
        except DB_ERRORS as exc:
            log.warning("reconcile skipped: %s", one_line(exc, with_type=True))
            return []
        for run in converged:
            log.info("reconciled run %s: lease expired, now %s", run.id, run.status)
        return converged
