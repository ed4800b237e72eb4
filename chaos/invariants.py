"""The crash-safety invariants, each a function returning the violating run ids (id -> why).

Readers (`load_state`, `sample_owners`, `snapshot_finished_attempts`, `runs_in_flight_on`) use
plain SQL over unqualified table names, so a test can point them at a scratch copy of the
tables (`SET search_path`) holding a state the schema itself forbids. The checkers are pure
functions over what the readers returned and what the suite observed while it ran.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any, Final

import psycopg
from psycopg.rows import dict_row

from agent_runs.explain import LEASE_EXPIRED_ERROR, explain_run
from agent_runs.models import AgentRun, AttemptOutcome, RunAttempt, RunStatus

Violations = dict[str, str]  # run id -> what is wrong with it

_RUN_FIELDS: Final = tuple(f.name for f in fields(AgentRun))
_ATTEMPT_FIELDS: Final = tuple(f.name for f in fields(RunAttempt))

# One statement, one snapshot: runs with two open attempts, and runs whose lease owner is not
# the owner of their open attempt (an owner on the run with no open attempt, or the reverse).
SAMPLE_OWNERS_SQL: Final = """
WITH open_attempts AS (
    SELECT run_id, worker_id FROM agent_run_attempts WHERE finished_at IS NULL
),
multi AS (
    SELECT run_id, count(*) AS n FROM open_attempts GROUP BY run_id HAVING count(*) > 1
)
SELECT run_id, n || ' open attempts at once' AS why FROM multi
UNION ALL
SELECT coalesce(r.id, o.run_id),
       'run owner ' || coalesce(r.worker_id, '(none)')
           || ' but open attempt owner ' || coalesce(o.worker_id, '(none)')
FROM agent_runs r
FULL JOIN open_attempts o ON o.run_id = r.id
WHERE r.worker_id IS DISTINCT FROM o.worker_id
  AND coalesce(r.id, o.run_id) NOT IN (SELECT run_id FROM multi)
"""

# Finished attempts as stored, as text: compared byte for byte later.
SNAPSHOT_SQL: Final = """
SELECT a.id, a.run_id, a::text AS row_text
FROM agent_run_attempts a
WHERE a.finished_at IS NOT NULL
ORDER BY a.id
"""

# The runs that were in flight on a worker process that died: its attempts still open, or
# converged to lease_expired after the last moment the process was seen alive.
IN_FLIGHT_SQL: Final = """
SELECT DISTINCT run_id
FROM agent_run_attempts
WHERE starts_with(worker_id, %(prefix)s)
  AND (finished_at IS NULL
       OR (outcome = 'lease_expired' AND finished_at >= %(since)s::timestamptz))
ORDER BY run_id
"""


@dataclass(frozen=True, slots=True)
class DbState:
    """Every run and every attempt in the database, attempts ordered by attempt_no."""

    runs: dict[str, AgentRun]
    attempts: dict[str, list[RunAttempt]]

    @property
    def attempt_count(self) -> int:
        return sum(len(a) for a in self.attempts.values())


@dataclass(frozen=True, slots=True)
class OwnerSample:
    """One periodic look at ownership: the database clock and the runs seen with two owners."""

    db_now: datetime
    open_attempts: int
    violations: Violations


@dataclass(frozen=True, slots=True)
class AttemptFact:
    run_id: str
    row_text: str


@dataclass(slots=True)
class FactLedger:
    """The first text seen of every finished attempt, and any change seen between samples."""

    first_seen: dict[int, AttemptFact] = field(default_factory=dict)
    changed: Violations = field(default_factory=dict)
    samples: int = 0

    def observe(self, snapshot: Mapping[int, AttemptFact]) -> None:
        self.samples += 1
        for attempt_id, fact in snapshot.items():
            seen = self.first_seen.setdefault(attempt_id, fact)
            if seen.row_text != fact.row_text:
                self.changed.setdefault(
                    seen.run_id,
                    f"finished attempt id={attempt_id} changed between samples: "
                    f"{seen.row_text} -> {fact.row_text}",
                )
        for attempt_id, seen in self.first_seen.items():
            if attempt_id not in snapshot:
                self.changed.setdefault(
                    seen.run_id, f"finished attempt id={attempt_id} vanished: {seen.row_text}"
                )


# -- readers ---------------------------------------------------------------------------------


def load_state(conn: psycopg.Connection[Any]) -> DbState:
    """Read every run and attempt (one repeatable-read snapshot)."""
    with conn.transaction(), conn.cursor(row_factory=dict_row) as cur:
        cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        run_rows = cur.execute("SELECT * FROM agent_runs ORDER BY id").fetchall()
        attempt_rows = cur.execute(
            "SELECT * FROM agent_run_attempts ORDER BY run_id, attempt_no, id"
        ).fetchall()
    runs = {row["id"]: AgentRun(**{k: row[k] for k in _RUN_FIELDS}) for row in run_rows}
    attempts: dict[str, list[RunAttempt]] = {run_id: [] for run_id in runs}
    for row in attempt_rows:
        attempt = RunAttempt(**{k: row[k] for k in _ATTEMPT_FIELDS})
        attempts.setdefault(attempt.run_id, []).append(attempt)
    return DbState(runs=runs, attempts=attempts)


def sample_owners(conn: psycopg.Connection[Any]) -> OwnerSample:
    """Take one ownership sample (see SAMPLE_OWNERS_SQL)."""
    with conn.transaction(), conn.cursor() as cur:
        cur.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        row = cur.execute(
            "SELECT now(), (SELECT count(*) FROM agent_run_attempts WHERE finished_at IS NULL)"
        ).fetchone()
        assert row is not None
        db_now, open_count = row
        found = cur.execute(SAMPLE_OWNERS_SQL).fetchall()
    violations: Violations = {}
    for run_id, why in found:
        violations.setdefault(str(run_id), str(why))
    return OwnerSample(db_now=db_now, open_attempts=int(open_count), violations=violations)


def snapshot_finished_attempts(conn: psycopg.Connection[Any]) -> dict[int, AttemptFact]:
    """Every finished attempt's stored row as text, by attempt id."""
    rows = conn.execute(SNAPSHOT_SQL).fetchall()
    return {int(r[0]): AttemptFact(run_id=str(r[1]), row_text=str(r[2])) for r in rows}


def runs_in_flight_on(
    conn: psycopg.Connection[Any], worker_name: str, *, since: datetime
) -> list[str]:
    """Runs a dead worker process (`--name worker_name`) was executing when it died."""
    rows = conn.execute(IN_FLIGHT_SQL, {"prefix": f"{worker_name}:", "since": since}).fetchall()
    return [str(r[0]) for r in rows]


# -- the invariants --------------------------------------------------------------------------


def nothing_lost(state: DbState, enqueued: Iterable[str]) -> Violations:
    """Every enqueued run exists and is terminal."""
    bad: Violations = {}
    for run_id in enqueued:
        run = state.runs.get(run_id)
        if run is None:
            bad[run_id] = "enqueued but missing from agent_runs"
        elif not run.is_terminal:
            bad[run_id] = f"still {run.status} (not terminal)"
    return dict(sorted(bad.items()))


def never_two_owners(state: DbState, sampled: Mapping[str, str]) -> Violations:
    """No run ever had two open attempts (sampled during the run and checked at the end), nor a
    lease owner other than its open attempt's; attempt numbers are exactly 1..n; a finished
    attempt's [started_at, finished_at] does not overlap a later attempt of the same run."""
    bad: Violations = {run_id: f"sampled: {why}" for run_id, why in sampled.items()}
    for run_id, attempts in state.attempts.items():
        if run_id in bad:
            continue
        problem = _ownership_problem(attempts)
        if problem is not None:
            bad[run_id] = problem
    return dict(sorted(bad.items()))


def _ownership_problem(attempts: list[RunAttempt]) -> str | None:
    ordered = sorted(attempts, key=lambda a: (a.attempt_no, a.id))
    still_open = [a.attempt_no for a in ordered if a.finished_at is None]
    if len(still_open) > 1:
        return f"{len(still_open)} open attempts at the end: {still_open}"
    numbers = [a.attempt_no for a in ordered]
    if numbers != list(range(1, len(ordered) + 1)):
        return f"attempt numbers are {numbers}, expected 1..{len(ordered)}"
    for i, earlier in enumerate(ordered):
        for later in ordered[i + 1 :]:
            if earlier.finished_at is None:
                return (
                    f"attempt {earlier.attempt_no} is still open while attempt "
                    f"{later.attempt_no} started at {later.started_at.isoformat()}"
                )
            if later.started_at < earlier.finished_at:
                return (
                    f"attempt {earlier.attempt_no} [{earlier.started_at.isoformat()}, "
                    f"{earlier.finished_at.isoformat()}] overlaps attempt {later.attempt_no} "
                    f"started {later.started_at.isoformat()}"
                )
    return None


def facts_never_rewritten(
    ledger: FactLedger, final_snapshot: Mapping[int, AttemptFact]
) -> Violations:
    """Every finished attempt sampled during the run is byte-identical at the end."""
    bad: Violations = dict(ledger.changed)
    for attempt_id, seen in ledger.first_seen.items():
        if seen.run_id in bad:
            continue
        final = final_snapshot.get(attempt_id)
        if final is None:
            bad[seen.run_id] = f"finished attempt id={attempt_id} is gone: {seen.row_text}"
        elif final.row_text != seen.row_text:
            bad[seen.run_id] = (
                f"finished attempt id={attempt_id} was rewritten: "
                f"{seen.row_text} -> {final.row_text}"
            )
    return dict(sorted(bad.items()))


# How a policy with a lost-lease allowance may end a run after a lost lease.
_POLICY_ENDINGS: Final = frozenset(
    {LEASE_EXPIRED_ERROR, "lost_leases_exhausted", "retries_exhausted", "deadline_exceeded"}
)


def within_policy(state: DbState, *, max_attempts: int, max_lost_leases: int) -> Violations:
    """No run executed more often than its policy allows: at most max_attempts attempts
    (none of these runs is requeued) and at most max_lost_leases + 1 lost leases."""
    bad: Violations = {}
    for run_id, attempts in state.attempts.items():
        lost = sum(a.outcome == AttemptOutcome.LEASE_EXPIRED for a in attempts)
        if len(attempts) > max_attempts or lost > max_lost_leases + 1:
            bad[run_id] = (
                f"{len(attempts)} attempts ({lost} lost leases); the policy allows "
                f"{max_attempts} attempts and {max_lost_leases} lost leases"
            )
    return dict(sorted(bad.items()))


def history_explains_state(state: DbState) -> Violations:
    """explain_run (what `agent-runs attempts` prints) explains every run's status."""
    bad: Violations = {}
    for run_id, run in state.runs.items():
        explanation = explain_run(run, state.attempts.get(run_id, []))
        if not explanation.explained:
            bad[run_id] = explanation.text
    return dict(sorted(bad.items()))


@dataclass(frozen=True, slots=True)
class Expectation:
    """How a scripted run must end when no worker executing it died."""

    status: RunStatus
    error_type: str | None = None  # None: not judged
    attempts: int | None = None  # None: not judged
    even_if_killed: bool = False  # hang and crash end this way whoever dies


def expectation_for(
    script: Sequence[str], *, max_tries: int, max_lost_leases: int = 0
) -> Expectation | None:
    """What a script of ScriptedAgent steps must produce, or None for scripts not judged. With
    a lost-lease allowance, `hang` and `crash` are poison runs: retried while the policy allows
    (max_tries attempts), then ended by it."""
    steps = list(script)
    if not steps:
        return None
    if all(step == "ok" for step in steps):
        return Expectation(RunStatus.COMPLETED, attempts=1)
    if len(steps) == 1:
        step = steps[0]
        name, _, arg = step.partition(":")
        if step == "retry":
            return Expectation(RunStatus.FAILED, "retries_exhausted", attempts=max_tries)
        if name == "fail" and arg:
            return Expectation(RunStatus.FAILED, arg, attempts=1)
        if step == "interrupt":
            return Expectation(RunStatus.INTERRUPTED, attempts=1)
        if name == "sleep":
            return Expectation(RunStatus.COMPLETED, attempts=1)
        if step == "wait_cancel":  # cancelled while pending (no attempt) or while running
            return Expectation(RunStatus.CANCELLED)
        if step in ("hang", "crash") and max_lost_leases:
            poison = max_lost_leases + 1 <= max_tries
            return Expectation(
                RunStatus.FAILED,
                "lost_leases_exhausted" if poison else "retries_exhausted",
                attempts=min(max_lost_leases + 1, max_tries),
                even_if_killed=True,
            )
        if step in ("hang", "crash"):
            return Expectation(
                RunStatus.FAILED, LEASE_EXPIRED_ERROR, attempts=1, even_if_killed=True
            )
        return None
    *retries, last = steps
    if all(step == "retry" for step in retries) and last == "ok" and len(steps) <= max_tries:
        return Expectation(RunStatus.COMPLETED, attempts=len(steps))
    return None


def scripted_expectations(
    state: DbState,
    scripts: Mapping[str, Sequence[str]],
    killed: Iterable[str],
    *,
    max_tries: int = 3,
    max_lost_leases: int = 0,
) -> Violations:
    """A run whose script is all `ok` completed, unless it was in flight on a worker process
    that died (SIGKILL or a scripted crash): then it is failed / worker_lease_expired and its
    last attempt ended lease_expired. The same holds for every other step of the mix, each
    with its own ending (`expectation_for`): retry then ok completes on the attempt after the
    retries, `fail:T` fails with T, `wait_cancel` is cancelled, `hang` and `crash` always end
    failed / worker_lease_expired, and so on."""
    killed_ids = set(killed)
    bad: Violations = {}
    for run_id, script in scripts.items():
        expected = expectation_for(script, max_tries=max_tries, max_lost_leases=max_lost_leases)
        if expected is None:
            continue
        run = state.runs.get(run_id)
        if run is None:
            bad[run_id] = "scripted run is missing"
            continue
        attempts = state.attempts.get(run_id, [])
        last = attempts[-1] if attempts else None
        got = (
            f"{run.status} ({run.error_type}) after {len(attempts)} attempt(s), last "
            f"{last.outcome if last else None}"
        )
        lost = any(a.outcome == AttemptOutcome.LEASE_EXPIRED for a in attempts)
        if max_lost_leases and not expected.even_if_killed and (run_id in killed_ids or lost):
            # A lost lease the policy retried: the script's ending, after more attempts; or the
            # policy ended it after a lease it lost.
            if run.status == expected.status and (
                expected.error_type is None or run.error_type == expected.error_type
            ):
                continue
            if (
                run.status == RunStatus.FAILED
                and run.error_type in _POLICY_ENDINGS
                and last is not None
                and last.outcome == AttemptOutcome.LEASE_EXPIRED
            ):
                continue
            bad[run_id] = f"script {list(script)} lost a lease and ended {got}"
            continue
        if run_id in killed_ids or expected.even_if_killed:
            if (
                run.status == RunStatus.FAILED
                and run.error_type
                == (expected.error_type if expected.even_if_killed else LEASE_EXPIRED_ERROR)
                and last is not None
                and last.outcome == AttemptOutcome.LEASE_EXPIRED
            ):
                continue
            if run_id in killed_ids:
                bad[run_id] = (
                    f"script {list(script)} was in flight on a killed worker but ended {got}; "
                    f"expected failed ({LEASE_EXPIRED_ERROR}) with a lease_expired attempt"
                )
                continue
        if (
            run.status != expected.status
            or (expected.error_type is not None and run.error_type != expected.error_type)
            or (expected.attempts is not None and len(attempts) != expected.attempts)
        ):
            want = str(expected.status)
            if expected.error_type is not None:
                want += f" ({expected.error_type})"
            if expected.attempts is not None:
                want += f" after {expected.attempts} attempt(s)"
            bad[run_id] = (
                f"script {list(script)} ended {got}; expected {want} "
                "(no worker executing it was killed)"
            )
    return dict(sorted(bad.items()))
