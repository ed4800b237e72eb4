"""The chaos run itself: enqueue, drive processes, inject faults, sample, drain, check (the
checks and the summary: chaos/verdict.py)."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import psycopg
from psycopg import sql

from agent_runs.devtools.embedded import EmbeddedServer, embedded_postgres
from agent_runs.migrate import apply_migrations
from agent_runs.models import TERMINAL_STATUSES
from agent_runs.repository import AgentRunRepository
from chaos import invariants as inv
from chaos.faults import Supervisor, WorkerSettings, stop_server_now
from chaos.injector import FaultInjector
from chaos.options import Options
from chaos.report import Summary
from chaos.scenario import AGENT_SLUG, UID, Plan, PlannedRun
from chaos.suite_db import SuiteDb, status_counts
from chaos.verdict import Death, FaultStats, Verdict

DATABASE: Final = "agent_runs_chaos"
TICK: Final = 0.1
OWNER_SAMPLE_EVERY: Final = 0.5
FACT_SNAPSHOT_EVERY: Final = 2.0
PROGRESS_EVERY: Final = 5.0
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_TERMINAL: Final = tuple(str(s) for s in TERMINAL_STATUSES)


class Suite(Verdict):
    """One chaos run against the suite's own embedded server (see `run_chaos`)."""

    def __init__(
        self, options: Options, plan: Plan, server: EmbeddedServer, dsn: str, log_dir: Path
    ) -> None:
        self.o = options
        self.plan = plan
        self.server = server
        self.dsn = dsn
        self.log_dir = log_dir
        self.db = SuiteDb(dsn)
        self.supervisor = Supervisor(
            dsn,
            WorkerSettings(
                concurrency=options.concurrency,
                lease_seconds=options.lease_seconds,
                heartbeat_seconds=options.heartbeat_seconds,
                max_tries=options.max_tries,
                poll_seconds=options.poll_seconds,
                completion=options.completion,
                reconcile_every=max(0.5, options.lease_seconds / 3),
            ),
            log_dir,
        )
        self.stats = FaultStats()
        self.enqueued: dict[str, PlannedRun] = {}
        self.cancelled: set[str] = set()
        self.owner_violations: inv.Violations = {}
        self.owner_samples = 0
        self.max_open_attempts = 0
        self.ledger = inv.FactLedger()
        self.unexpected: list[str] = []
        self.problems: list[str] = []
        self.notes: list[str] = []
        self.deaths: list[Death] = []
        self.restart_windows: list[tuple[datetime, datetime]] = []  # database clock
        self.injector = FaultInjector(
            options=options,
            server=server,
            db=self.db,
            supervisor=self.supervisor,
            stats=self.stats,
            say=self.say,
            restart_windows=self.restart_windows,
        )
        self._t0 = time.monotonic()
        self._next_sample = 0.0
        self._next_snapshot = 0.0
        self._next_progress = PROGRESS_EVERY
        self.phase = "start"
        self.stopping = False

    # -- helpers -----------------------------------------------------------------------------

    def elapsed(self) -> float:
        return time.monotonic() - self._t0

    def say(self, message: str) -> None:
        if not self.o.quiet:
            print(f"[{self.elapsed():6.1f}s] {message}", flush=True)

    # -- the run -------------------------------------------------------------------------------

    def run(self) -> None:
        self._t0 = time.monotonic()
        self.phase = "faults"
        self.supervisor.start_reconciler()
        for slot in range(1, self.o.workers + 1):
            self.supervisor.start_worker(slot)
        self.say(
            f"started {self.o.workers} workers (concurrency {self.o.concurrency}, lease "
            f"{self.o.lease_seconds:g}s, heartbeat {self.o.heartbeat_seconds:g}s) and a reconciler"
        )
        runs = deque(self.plan.runs)
        faults = deque(self.plan.faults)
        cancels = deque(
            sorted(
                (r for r in self.plan.runs if r.cancel_at is not None),
                key=lambda r: (r.cancel_at or 0.0, r.index),
            )
        )
        drain_started = 0.0
        next_terminal_check = 0.0
        while True:
            now = self.elapsed()
            if now > self.o.deadline:
                self.problems.append(
                    f"the suite hit its --deadline of {self.o.deadline:g}s in phase {self.phase}"
                )
                break
            self._enqueue_due(runs, now)
            self._cancel_due(cancels, now)
            if self.phase == "faults":
                self.injector.inject_due(faults, now)
            self._sample_if_due(now)
            self._supervise()
            if self.phase == "faults" and now >= self.o.duration and not faults and not runs:
                self.phase = "drain"
                drain_started = now
                self.say("faults stopped; draining until every run is terminal")
            if self.phase == "drain":
                if cancels:  # every wait_cancel run still waiting gets its request now
                    self._cancel_due(cancels, float("inf"))
                if now >= next_terminal_check:
                    next_terminal_check = now + 0.5
                    if self._all_terminal():
                        self.say(f"drained in {now - drain_started:.1f}s")
                        break
                if now - drain_started > self.o.drain_seconds:
                    self.problems.append(
                        f"runs still not terminal after a {self.o.drain_seconds:g}s drain"
                    )
                    break
            if now >= self._next_progress:
                self._next_progress = now + PROGRESS_EVERY
                self._progress()
            time.sleep(TICK)
        self.phase = "stop"

    def stop_processes(self) -> None:
        """SIGTERM every process; an exit other than 0 at this point is a failure too."""
        self.stopping = True
        self._supervise()  # deaths since the last tick are deaths, not exits on SIGTERM
        grace = self.o.lease_seconds + 5.0
        for process in self.supervisor.stop_all(grace=grace):
            if process.killed_by_suite and process.exit_code is not None and process.exit_code < 0:
                self.unexpected.append(
                    f"{process.role} {process.name} (pid {process.pid}) did not exit within "
                    f"{grace:g}s of SIGTERM; log {process.log_path}:\n{process.log_tail()}"
                )
            elif process.exit_code != 0:
                self.unexpected.append(
                    f"{process.role} {process.name} (pid {process.pid}) exited "
                    f"{process.exit_code} on SIGTERM; log {process.log_path}:\n"
                    f"{process.log_tail()}"
                )

    # -- enqueue and cancel --------------------------------------------------------------------

    def _enqueue_due(self, runs: deque[PlannedRun], now: float) -> None:
        while runs and runs[0].enqueue_at <= now:
            run = runs[0]

            def create(conn: psycopg.Connection[Any], run: PlannedRun = run) -> str:
                created = AgentRunRepository(conn).create_run(
                    thread_id=run.thread_id,
                    agent_slug=AGENT_SLUG,
                    uid=UID,
                    request_id=run.request_id,  # idempotent: a retry after a lost reply is safe
                    input_payload={"script": list(run.script)},
                    run_id=run.run_id,
                )
                return created.id

            if self.db.attempt(create) is None:
                return  # the database is away: try again next tick
            self.enqueued[run.run_id] = run
            runs.popleft()

    def _cancel_due(self, cancels: deque[PlannedRun], now: float) -> None:
        while cancels and (cancels[0].cancel_at or 0.0) <= now:
            run = cancels[0]
            if run.run_id not in self.enqueued:
                return

            def cancel(conn: psycopg.Connection[Any], run_id: str = run.run_id) -> bool:
                AgentRunRepository(conn).request_cancel(run_id)
                return True

            if self.db.attempt(cancel) is None:
                return
            self.cancelled.add(run.run_id)
            self.stats.cancel_requests += 1
            cancels.popleft()

    # -- watching ------------------------------------------------------------------------------

    def _sample_if_due(self, now: float) -> None:
        if now >= self._next_sample:
            sample = self.db.attempt(inv.sample_owners)
            if sample is not None:
                self._next_sample = now + OWNER_SAMPLE_EVERY
                self.owner_samples += 1
                self.max_open_attempts = max(self.max_open_attempts, sample.open_attempts)
                for run_id, why in sample.violations.items():
                    self.owner_violations.setdefault(
                        run_id, f"{why} (sample at {sample.db_now.isoformat()})"
                    )
                for process in self.supervisor.alive():
                    process.last_alive_db = sample.db_now
        if now >= self._next_snapshot:
            snapshot = self.db.attempt(inv.snapshot_finished_attempts)
            if snapshot is not None:
                self._next_snapshot = now + FACT_SNAPSHOT_EVERY
                self.ledger.observe(snapshot)

    def _supervise(self) -> None:
        for process in self.supervisor.reap():
            since = process.last_alive_db or _EPOCH
            if process.role == "reconciler":
                self.unexpected.append(
                    f"reconciler {process.name} (pid {process.pid}) exited {process.exit_code}; "
                    f"log {process.log_path}:\n{process.log_tail()}"
                )
                if not self.stopping:
                    self.supervisor.start_reconciler()
                continue
            if process.killed_by_suite:
                kind = "sigkill"
            elif process.crashed_on_script():
                kind = "crash"
                self.stats.crash_exits += 1
            else:
                kind = "unexpected"
                self.unexpected.append(
                    f"worker {process.name} (pid {process.pid}) exited {process.exit_code} "
                    f"without being killed or reaching a crash step; log {process.log_path}:\n"
                    f"{process.log_tail()}"
                )
                self.say(f"UNEXPECTED: worker {process.name} exited {process.exit_code}")
            self.deaths.append(Death(process, since, kind))
            if not self.stopping:
                self.supervisor.start_worker(process.slot)

    def _all_terminal(self) -> bool:
        if len(self.enqueued) < len(self.plan.runs):
            return False
        ids = list(self.enqueued)

        def open_count(conn: psycopg.Connection[Any]) -> int:
            row = conn.execute(
                "SELECT count(*) FROM agent_runs WHERE id = ANY(%s) AND NOT status = ANY(%s)",
                (ids, list(_TERMINAL)),
            ).fetchone()
            return int(row[0]) if row else -1

        return self.db.attempt(open_count) == 0

    def _progress(self) -> None:
        counts = self.db.attempt(status_counts)
        shown = " ".join(f"{k} {v}" for k, v in sorted(counts.items())) if counts else "(db away)"
        s = self.stats
        self.say(
            f"{self.phase}: enqueued {len(self.enqueued)}/{len(self.plan.runs)} [{shown}] | "
            f"sigkill {s.sigkills}, crash exits {s.crash_exits}, terminations "
            f"{s.terminate_events}, restarts {s.restarts} | workers "
            f"{len(self.supervisor.alive('worker'))}/{self.o.workers}"
        )


def _create_database(server: EmbeddedServer) -> str:
    with psycopg.connect(server.url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
    url = server.url_for(DATABASE)
    apply_migrations(url)
    return url


def _set_policy(dsn: str, options: Options) -> None:
    """The scripted agent's recovery policy: max_tries attempts, the lost-lease allowance and
    back-off of the options (none at all when both are 0: the built-in policy)."""
    if not options.max_lost_leases and not options.backoff_seconds:
        return
    with psycopg.connect(dsn, autocommit=True) as conn:
        AgentRunRepository(conn).set_policy(
            AGENT_SLUG,
            max_attempts=options.max_tries,
            max_lost_leases=options.max_lost_leases,
            backoff_seconds=options.backoff_seconds,
            backoff_max_seconds=options.backoff_seconds * 8,
            backoff_jitter=0.2,
        )


def run_chaos(options: Options, plan: Plan) -> Summary:
    """Start an embedded server, run the suite on it, check; always stop everything started."""
    started = time.monotonic()
    log_dir = Path(tempfile.mkdtemp(prefix="agent_runs-chaos-logs-"))
    keep_logs = options.keep_logs
    try:
        with embedded_postgres(prefix="agent_runs-chaos-pg-") as server:
            suite: Suite | None = None
            try:
                dsn = _create_database(server)
                _set_policy(dsn, options)
                print(
                    f"chaos: embedded PostgreSQL at {server.pgdata} (started by this suite), "
                    f"database {DATABASE}; logs in {log_dir}",
                    flush=True,
                )
                suite = Suite(options, plan, server, dsn, log_dir)
                try:
                    suite.run()
                finally:
                    suite.stop_processes()
                results, state = suite.check()
                summary = suite.summary(results, state, time.monotonic() - started)
                if not summary.ok:
                    keep_logs = True
                summary.processes.append(
                    f"logs       {log_dir}"
                    + ("" if keep_logs else " (removed: the run passed; --keep-logs keeps them)")
                )
                return summary
            finally:
                if suite is not None:
                    suite.supervisor.stop_all(grace=2.0)  # no-op unless interrupted
                    suite.db.close()
                stop_server_now(server)
    except BaseException:
        keep_logs = True
        print(f"chaos: worker and reconciler logs kept in {log_dir}", flush=True)
        raise
    finally:
        if not keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)
