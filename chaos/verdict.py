"""The verdict of a chaos run: every invariant over the final database, and the summary."""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import psycopg

from chaos import invariants as inv
from chaos.faults import ManagedProcess
from chaos.report import FaultLine, InvariantResult, Summary

if TYPE_CHECKING:
    from chaos.faults import Supervisor
    from chaos.options import Options
    from chaos.scenario import Plan, PlannedRun
    from chaos.suite_db import SuiteDb


@dataclass(slots=True)
class FaultStats:
    """How many faults of each kind the run injected, and what they hit."""

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


@dataclass(slots=True)
class Death:
    """A worker process that died (killed, crashed or unexpectedly) and since when."""

    process: ManagedProcess
    since: datetime
    kind: str  # "sigkill" | "crash" | "unexpected"


class Verdict:
    """The checks and the summary of `Suite` (chaos/suite.py), over what its run recorded."""

    if TYPE_CHECKING:
        o: Options
        plan: Plan
        db: SuiteDb
        supervisor: Supervisor
        stats: FaultStats
        enqueued: dict[str, PlannedRun]
        owner_violations: inv.Violations
        owner_samples: int
        max_open_attempts: int
        ledger: inv.FactLedger
        unexpected: list[str]
        problems: list[str]
        notes: list[str]
        deaths: list[Death]
        restart_windows: list[tuple[datetime, datetime]]

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
            if inv.expectation_for(
                r.script, max_tries=self.o.max_tries, max_lost_leases=self.o.max_lost_leases
            )
            is not None
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
                inv.scripted_expectations(
                    state,
                    scripts,
                    killed,
                    max_tries=self.o.max_tries,
                    max_lost_leases=self.o.max_lost_leases,
                ),
            ),
            InvariantResult(
                "within the policy",
                f"{self.o.max_tries} attempts, {self.o.max_lost_leases} lost leases allowed",
                inv.within_policy(
                    state,
                    max_attempts=self.o.max_tries,
                    max_lost_leases=self.o.max_lost_leases,
                ),
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


def _in_flight(death: Death, conn: psycopg.Connection[Any]) -> list[str]:
    return inv.runs_in_flight_on(conn, death.process.name, since=death.since)


def _hms(value: datetime | None) -> str:
    return value.astimezone(UTC).strftime("%H:%M:%S.%f")[:-3] if value is not None else "never"
