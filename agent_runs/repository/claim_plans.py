"""What every claim shares: the lost-lease message, the retry of a lost attempt_no race, the
parameters of a claim of the next run, and new run ids."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, LiteralString

import psycopg
from psycopg import errors as pg_errors

from agent_runs import validation as check
from agent_runs.errors import UQ_ONE_OPEN_ATTEMPT, UQ_RUN_ATTEMPT_NO
from agent_runs.models import ClaimedRun
from agent_runs.rows import run_of, utc
from agent_runs.steps import Execute, Plan
from agent_runs.transport import Row, statement

if TYPE_CHECKING:  # never imported at run time: telemetry off costs no import
    from agent_runs.telemetry import Telemetry

LEASE_EXPIRED_MESSAGE: Final = (
    "the worker's lease expired before it reported a result: the outcome is unknown. Under "
    "at-least-once semantics the agent may have run partly or fully; check its side effects "
    "before running it again."
)

# A claim computes attempt_no = max + 1 from its statement's snapshot. If another claimer
# committed a claim *and* a release between that snapshot and our lock, the database refuses
# the duplicate; a new statement (new snapshot) then sees it. Bounded: the race is rare.
_CLAIM_RACE_CONSTRAINTS: Final = frozenset({UQ_RUN_ATTEMPT_NO, UQ_ONE_OPEN_ATTEMPT})
_CLAIM_TRIES: Final = 5


def claim(name: LiteralString, params: Mapping[str, Any]) -> Plan[list[Row]]:
    """Run a claim's statement, again (a new snapshot) when it lost the attempt_no race."""
    for tries_left in range(_CLAIM_TRIES - 1, -1, -1):
        try:
            rows: list[Row] = yield Execute(statement(name), params)
            return rows
        except pg_errors.UniqueViolation as exc:
            if exc.diag.constraint_name not in _CLAIM_RACE_CONSTRAINTS or not tries_left:
                raise
    raise AssertionError("unreachable")  # pragma: no cover


def next_claim(
    worker_id: str, lease_seconds: float, now: datetime | None, agent_slugs: list[str] | None
) -> dict[str, Any]:
    """The checked parameters of sql/claim_next.sql."""
    return {
        "worker_id": check.worker_id(worker_id),
        **check.lease(lease_seconds, now),
        "agent_slugs": check.agent_slugs(agent_slugs),
        "lost_message": LEASE_EXPIRED_MESSAGE,
    }


def claimed(telemetry: Telemetry, runs: Sequence[ClaimedRun]) -> Plan[None]:
    """Telemetry of committed claims; a retry's pickup starts when the attempt before it
    ended, read in one statement (telemetry on, retries only)."""
    retries = [c for c in runs if c.attempt_no > 1]
    released: dict[str, datetime] = {}
    if retries:
        try:
            rows: list[Row] = yield Execute(
                statement("claim_next.released"),
                {
                    "run_ids": [c.run.id for c in retries],
                    "attempt_nos": [c.attempt_no for c in retries],
                },
            )
        except psycopg.Error:  # the claims committed: a pickup metric is not worth their answer
            rows = []
        released = {row["run_id"]: utc(row["finished_at"]) for row in rows}
    telemetry.claimed(runs, released)


def first_claimed(telemetry: Telemetry | None, rows: list[Row]) -> Plan[ClaimedRun | None]:
    """The run claim_next's answer claimed, with its attempt_no (and its telemetry)."""
    if not rows:
        return None
    found = ClaimedRun(run_of(rows[0]), int(rows[0]["attempt_no"]))
    if telemetry is not None:
        yield from claimed(telemetry, [found])
    return found
