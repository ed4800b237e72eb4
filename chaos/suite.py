"""The chaos run itself: enqueue, drive processes, inject faults, sample, drain, check."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import shutil
import tempfile
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, TypeVar

import psycopg
from psycopg import sql

from agent_runs.devtools.embedded import EmbeddedServer, embedded_postgres
from agent_runs.migrate import apply_migrations
from agent_runs.models import TERMINAL_STATUSES
from agent_runs.repository import AgentRunRepository
from chaos import invariants as inv
from chaos.faults import (
    SUITE_APP,
    ManagedProcess,
    Supervisor,
    WorkerSettings,
    in_flight_by_worker,
    restart_server,
    stop_server_now,
    terminate_worker_backends,
    with_application_name,
)
from chaos.report import FaultLine, InvariantResult, Summary
from chaos.scenario import AGENT_SLUG, UID, Plan, PlannedFault, PlannedRun

T = TypeVar("T")

DATABASE: Final = "agent_runs_chaos"
TICK: Final = 0.1
OWNER_SAMPLE_EVERY: Final = 0.5
FACT_SNAPSHOT_EVERY: Final = 2.0
PROGRESS_EVERY: Final = 5.0
FAULT_RETRY_DELAY: Final = 0.4
KILL_WAIT_FOR_BUSY: Final = 8  # retries looking for a worker that is mid-run before any kill
DB_ERRORS: Final = (psycopg.OperationalError, psycopg.InterfaceError)
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
_TERMINAL: Final = tuple(str(s) for s in TERMINAL_STATUSES)


@dataclass(frozen=True, slots=True)
class Options:
    """The command line of `python -m chaos`, resolved."""

    seed: int
    runs: int
    workers: int
    concurrency: int
    lease_seconds: float
    heartbeat_seconds: float
    max_tries: int
    poll_seconds: float
    completion: str
    duration: float
    drain_seconds: float
    deadline: float
    terminations: int
    kills: int
    restarts: int
    restart_downtime: float
    keep_logs: bool
    quiet: bool


@dataclass(slots=True)
class FaultStats:
    sigkills: int = 0
    sigkill_in_flight: int = 0
    sigkill_idle: int = 0
    crash_exits: int = 0
    crash_in_flight: int = 0
    terminate_events: int = 0
    terminated_backends: int = 0
    terminated_busy: int = 0
    restarts: int = 0
    restart_seconds: list[float] = field(default_factory=list)
    cancel_requests: int = 0


class SuiteDb:
    """The suite's own session (application_name chaos-suite), reconnected after any fault."""

    def __init__(self, dsn: str) -> None:
        self.dsn = with_application_name(dsn, SUITE_APP)
        self._conn: psycopg.Connection[Any] | None = None
        self.errors = 0

    def conn(self) -> psycopg.Connection[Any]:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(
                self.dsn,
                autocommit=True,
                connect_timeout=3,
                options="-c TimeZone=UTC -c statement_timeout=15000",
            )
        return self._conn

    def reset(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None

    def attempt(self, call: Callable[[psycopg.Connection[Any]], T]) -> T | None:
        """`call(conn)`, or None when the database failed it (the session is reset)."""
        try:
            return call(self.conn())
        except DB_ERRORS:
            self.errors += 1
            self.reset()
            return None

    def must(self, call: Callable[[psycopg.Connection[Any]], T], *, timeout: float = 60.0) -> T:
        """`call(conn)`, retried across database failures for up to `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return call(self.conn())
            except DB_ERRORS:
                self.errors += 1
                self.reset()
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.3)

    def close(self) -> None:
        self.reset()


@dataclass(slots=True)
class _Death:
    process: ManagedProcess
    since: datetime
    kind: str  # "sigkill" | "crash" | "unexpected"


class Suite:
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
        self.deaths: list[_Death] = []
        self.restart_windows: list[tuple[datetime, datetime]] = []  # database clock
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
                self._inject_due(faults, now)
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

    # -- faults --------------------------------------------------------------------------------

    def _inject_due(self, faults: deque[PlannedFault], now: float) -> None:
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
        db_now = self.db.attempt(_db_now)
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
            f"pg_ctl stop -m fast, {self.o.restart_downtime:g}s down, pg_ctl start"
            if self.o.restart_downtime > 0
            else "pg_ctl restart -m fast"
        )
        self.say(f"restarting PostgreSQL ({how}) while workers run")
        before = self.db.attempt(_db_now)
        seconds = restart_server(self.server, downtime=self.o.restart_downtime)
        self.db.reset()
        self.stats.restarts += 1
        self.stats.restart_seconds.append(seconds)
        after = self.db.attempt(_db_now)
        if before is not None and after is not None:
            self.restart_windows.append((before, after))
        self.say(f"PostgreSQL is back after {seconds:.2f}s")
        return True

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
            self.deaths.append(_Death(process, since, kind))
            if not self.stopping:
                self.supervisor.start_worker(process.slot)

    def _runs_killed(self) -> set[str]:
        """The runs in flight on each worker process that died, read once everything settled:
        its attempts converged to lease_expired (or still open) after it was last seen alive.
        Read at the end, so that a claim the server committed for a client already dead is
        counted too."""
        killed: set[str] = set()
        for death in self.deaths:
            runs = self.db.must(functools.partial(_in_flight, death))
            killed.update(runs)
            if death.kind == "sigkill":
                self.stats.sigkill_in_flight += len(runs)
            elif death.kind == "crash":
                self.stats.crash_in_flight += len(runs)
        return killed

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
        counts = self.db.attempt(_status_counts)
        shown = " ".join(f"{k} {v}" for k, v in sorted(counts.items())) if counts else "(db away)"
        s = self.stats
        self.say(
            f"{self.phase}: enqueued {len(self.enqueued)}/{len(self.plan.runs)} [{shown}] | "
            f"sigkill {s.sigkills}, crash exits {s.crash_exits}, terminations "
            f"{s.terminate_events}, restarts {s.restarts} | workers "
            f"{len(self.supervisor.alive('worker'))}/{self.o.workers}"
        )

    # -- the verdict ----------------------------------------------------------------------------

    def check(self) -> tuple[list[InvariantResult], inv.DbState]:
        """Final sample and snapshot, then every invariant over the whole database."""
        final_sample = self.db.must(inv.sample_owners)
        self.owner_samples += 1
        for run_id, why in final_sample.violations.items():
            self.owner_violations.setdefault(run_id, f"{why} (final sample)")
        final_snapshot = self.db.must(inv.snapshot_finished_attempts)
        sampled_facts = len(self.ledger.first_seen)
        state = self.db.must(inv.load_state)
        killed = self._runs_killed()
        scripts = {run_id: run.script for run_id, run in self.enqueued.items()}
        planned_ids = [r.run_id for r in self.plan.runs]
        all_ok = sum(1 for r in self.enqueued.values() if r.all_ok)
        all_ok_killed = sum(1 for r in self.enqueued.values() if r.all_ok and r.run_id in killed)
        judged = sum(
            1
            for r in self.enqueued.values()
            if inv.expectation_for(r.script, max_tries=self.o.max_tries) is not None
        )
        results = [
            InvariantResult(
                "nothing lost",
                f"{len(planned_ids)} runs",
                inv.nothing_lost(state, planned_ids),
            ),
            InvariantResult(
                "never two owners",
                f"{len(state.runs)} runs, {self.owner_samples} samples",
                inv.never_two_owners(state, self.owner_violations),
            ),
            InvariantResult(
                "facts never rewritten",
                f"{sampled_facts} facts, {self.ledger.samples} snapshots",
                inv.facts_never_rewritten(self.ledger, final_snapshot),
            ),
            InvariantResult(
                "history explains the state",
                f"{len(state.runs)} runs",
                inv.history_explains_state(state),
            ),
            InvariantResult(
                "scripted expectations",
                f"{judged} runs ({all_ok} all-ok, {all_ok_killed} of them killed; "
                f"{len(killed)} runs killed in all)",
                inv.scripted_expectations(state, scripts, killed, max_tries=self.o.max_tries),
            ),
        ]
        return results, state

    def summary(
        self, results: list[InvariantResult], state: inv.DbState, runtime: float
    ) -> Summary:
        s = self.stats
        restart_detail = ", ".join(f"{x:.2f}s" for x in s.restart_seconds)
        faults = [
            FaultLine(
                "SIGKILL worker",
                s.sigkills,
                f"{s.sigkill_in_flight} runs in flight"
                + (f", {s.sigkill_idle} without a run" if s.sigkill_idle else ""),
            ),
            FaultLine(
                "crash step (exit 137)",
                s.crash_exits,
                f"{s.crash_in_flight} runs in flight (the crashing one included)",
            ),
            FaultLine(
                "pg_terminate_backend",
                s.terminate_events,
                f"{s.terminated_backends} backends, {s.terminated_busy} busy when cut",
            ),
            FaultLine("PostgreSQL restart", s.restarts, f"back in {restart_detail or '-'}"),
            FaultLine("cancel request", s.cancel_requests, "request_cancel by the suite"),
        ]
        workers = [p for p in self.supervisor.processes if p.role == "worker"]
        reconcilers = [p for p in self.supervisor.processes if p.role == "reconciler"]
        processes = [
            f"processes  {len(workers)} workers started ({len(workers) - self.o.workers} "
            f"replacements), {len(reconcilers)} reconciler(s); unexpected exits "
            f"{len(self.unexpected)}",
            f"sampling   {self.owner_samples} owner samples (max {self.max_open_attempts} open "
            f"attempts at once), {self.ledger.samples} fact snapshots; suite db errors "
            f"{self.db.errors} (reconnected)",
        ]
        problems = list(self.problems) + [f"process: {u}" for u in self.unexpected]
        notes = list(self.notes) + self._restart_notes(results, state)
        outcomes: Counter[str] = Counter(
            str(a.outcome) if a.outcome is not None else "open"
            for attempts in state.attempts.values()
            for a in attempts
        )
        return Summary(
            seed=self.plan.seed,
            runtime_seconds=runtime,
            runs_enqueued=len(self.enqueued),
            runs_planned=len(self.plan.runs),
            kinds=self.plan.kind_counts(),
            statuses=Counter(str(r.status) for r in state.runs.values()),
            attempts=state.attempt_count,
            outcomes=outcomes,
            faults=faults,
            processes=processes,
            invariants=results,
            problems=problems,
            notes=notes,
        )

    def _restart_notes(self, results: list[InvariantResult], state: inv.DbState) -> list[str]:
        """For violating runs whose lease expired: was that lease live across a restart?"""
        notes: list[str] = []
        violating = sorted({run_id for r in results for run_id in r.violations})
        for run_id in violating:
            attempts = state.attempts.get(run_id, [])
            last = attempts[-1] if attempts else None
            if last is None or last.outcome != "lease_expired" or last.lease_expires_at is None:
                continue
            for before, after in self.restart_windows:
                if last.lease_expires_at > before and (
                    last.heartbeat_at is None or last.heartbeat_at <= after
                ):
                    notes.append(
                        f"{run_id}: its lease (last renewed {_hms(last.heartbeat_at)}, live until "
                        f"{_hms(last.lease_expires_at)}) was live when the PostgreSQL restart "
                        f"began at {_hms(before)}; the server was back by {_hms(after)}, yet "
                        f"{last.worker_id} never renewed it again"
                    )
                    break
        return notes


def _in_flight(death: _Death, conn: psycopg.Connection[Any]) -> list[str]:
    return inv.runs_in_flight_on(conn, death.process.name, since=death.since)


def _hms(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%H:%M:%S.%f")[:-3] if value is not None else "never"


def _db_now(conn: psycopg.Connection[Any]) -> datetime:
    row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    value: datetime = row[0]
    return value


def _status_counts(conn: psycopg.Connection[Any]) -> dict[str, int]:
    rows = conn.execute("SELECT status, count(*) FROM agent_runs GROUP BY status").fetchall()
    return {str(r[0]): int(r[1]) for r in rows}


def _create_database(server: EmbeddedServer) -> str:
    with psycopg.connect(server.url, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(DATABASE)))
    url = server.url_for(DATABASE)
    apply_migrations(url)
    return url


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
