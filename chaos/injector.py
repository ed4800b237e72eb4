"""The chaos run's faults, due by the plan: terminate backends, SIGKILL a busy worker, restart
PostgreSQL; each counted, and a fault with no target now tried again a little later."""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from datetime import datetime
from typing import Final

from agent_runs.devtools.embedded import EmbeddedServer
from chaos.faults import Supervisor, in_flight_by_worker, restart_server, terminate_worker_backends
from chaos.options import Options
from chaos.scenario import PlannedFault
from chaos.suite_db import SuiteDb, database_now
from chaos.verdict import FaultStats

FAULT_RETRY_DELAY: Final = 0.4
KILL_WAIT_FOR_BUSY: Final = 8  # retries looking for a worker that is mid-run before any kill


class FaultInjector:
    """Injects the plan's faults into a running suite, counting them in `stats`."""

    def __init__(
        self,
        *,
        options: Options,
        server: EmbeddedServer,
        db: SuiteDb,
        supervisor: Supervisor,
        stats: FaultStats,
        say: Callable[[str], None],
        restart_windows: list[tuple[datetime, datetime]],
    ) -> None:
        self.options = options
        self.server = server
        self.db = db
        self.supervisor = supervisor
        self.stats = stats
        self.say = say
        self.restart_windows = restart_windows  # (before, after) each restart, database clock

    def inject_due(self, faults: deque[PlannedFault], now: float) -> None:
        while faults and faults[0].at <= now:
            fault = faults.popleft()
            if fault.kind == "terminate":
                done = self._terminate(fault)
            elif fault.kind == "sigkill":
                done = self._sigkill(fault)
            else:
                done = self._restart()
            if not done:  # no target right now (or the database is away): a little later
                faults.appendleft(
                    dataclasses.replace(fault, at=now + FAULT_RETRY_DELAY, tries=fault.tries + 1)
                )
                return

    def _terminate(self, fault: PlannedFault) -> bool:
        result = self.db.attempt(
            lambda conn: terminate_worker_backends(conn, pick=fault.pick, burst=fault.burst)
        )
        if result is None or not result.pids:
            return False
        self.stats.terminate_events += 1
        self.stats.terminated_backends += len(result.pids)
        self.stats.terminated_busy += result.active
        return True

    def _sigkill(self, fault: PlannedFault) -> bool:
        alive = {p.name: p for p in self.supervisor.alive("worker")}
        if not alive:
            return False
        busy = self.db.attempt(in_flight_by_worker)
        db_now = self.db.attempt(database_now)
        if busy is None or db_now is None:
            return False
        candidates = sorted(name for name in alive if busy.get(name, 0) > 0)
        if not candidates:
            if fault.tries < KILL_WAIT_FOR_BUSY:
                return False  # wait for a worker that is mid-run
            candidates = sorted(alive)
            self.stats.sigkill_idle += 1
        victim = alive[candidates[int(fault.pick * len(candidates))]]
        self.supervisor.sigkill(victim)
        self.stats.sigkills += 1
        # Everything it held from now on was in flight when it died.
        victim.last_alive_db = db_now
        self.say(
            f"SIGKILL worker {victim.name} (pid {victim.pid}), {busy.get(victim.name, 0)} run(s)"
        )
        return True

    def _restart(self) -> bool:
        if not self.supervisor.alive("worker"):
            return False
        how = (
            f"pg_ctl stop -m fast, {self.options.restart_downtime:g}s down, pg_ctl start"
            if self.options.restart_downtime > 0
            else "pg_ctl restart -m fast"
        )
        self.say(f"restarting PostgreSQL ({how}) while workers run")
        before = self.db.attempt(database_now)
        seconds = restart_server(self.server, downtime=self.options.restart_downtime)
        self.db.reset()
        self.stats.restarts += 1
        self.stats.restart_seconds.append(seconds)
        after = self.db.attempt(database_now)
        if before is not None and after is not None:
            self.restart_windows.append((before, after))
        self.say(f"PostgreSQL is back after {seconds:.2f}s")
        return True
