"""The hand-minimal floor statements and the seeding of the designs in bench.designs_ddl.

Written in the style of bench.floor and bench.lean_floor: one prepared autocommit statement per
transition, a data-modifying CTE writing the run and its attempt together. Names are
unqualified: each design's connections set search_path to its schema. Parameters by name:
worker_id, lease (seconds), run_id. `diet` runs bench.floor's statements unchanged (it has
today's columns); `lean_plus_checks` runs bench.lean_floor's with the schema name dropped.
Pickup is FIFO by (created_at, id) in every design.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Final, LiteralString

import psycopg

from bench import lean_floor


@dataclass(frozen=True)
class Statements:
    claim: LiteralString
    renew: LiteralString
    complete: LiteralString


_LEASE: Final = "now() + make_interval(secs => %(lease)s::float8)"

_OPEN_ATTEMPT: Final = """\
opened AS (
    INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, heartbeat_at,
                                    lease_expires_at)
    SELECT id,
           coalesce((SELECT max(attempt_no) FROM agent_run_attempts WHERE run_id = claimed.id),
                    0) + 1,
           %(worker_id)s::text, heartbeat_at, heartbeat_at, lease_expires_at
    FROM claimed
)
SELECT id FROM claimed"""

_RENEW_ATTEMPT: Final = """\
attempt AS (
    UPDATE agent_run_attempts a
    SET heartbeat_at = now(), lease_expires_at = renewed.lease_expires_at, updated_at = now()
    FROM renewed
    WHERE a.run_id = %(run_id)s::text AND a.finished_at IS NULL
)
SELECT run_id FROM renewed"""

_CLOSE_ATTEMPT: Final = """\
attempt AS (
    UPDATE agent_run_attempts a
    SET finished_at = now(), outcome = 'completed', updated_at = now()
    FROM finished
    WHERE a.run_id = %(run_id)s::text AND a.finished_at IS NULL
)"""

# split / split_keys: the claimable index is on the state row; renewals write only the state
# row and the attempt.
SPLIT: Final = Statements(
    claim=f"""\
WITH candidate AS (
    SELECT run_id FROM agent_run_state
    WHERE status = 'pending'
    ORDER BY created_at, run_id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
claimed AS (
    UPDATE agent_run_state s
    SET status = 'running', worker_id = %(worker_id)s::text, heartbeat_at = now(),
        lease_expires_at = {_LEASE}, started_at = now(), updated_at = now()
    FROM candidate
    WHERE s.run_id = candidate.run_id
    RETURNING s.run_id AS id, s.heartbeat_at, s.lease_expires_at
),
{_OPEN_ATTEMPT}""",  # noqa: S608
    renew=f"""\
WITH renewed AS (
    UPDATE agent_run_state
    SET heartbeat_at = now(), lease_expires_at = {_LEASE}, updated_at = now()
    WHERE run_id = %(run_id)s::text AND worker_id = %(worker_id)s::text
      AND lease_expires_at > now()
    RETURNING run_id, lease_expires_at
),
{_RENEW_ATTEMPT}""",  # noqa: S608
    complete=f"""\
WITH finished AS (
    UPDATE agent_run_state
    SET status = 'completed', finished_at = now(), worker_id = NULL, heartbeat_at = NULL,
        lease_expires_at = NULL, updated_at = now()
    WHERE run_id = %(run_id)s::text AND worker_id = %(worker_id)s::text AND status = 'running'
      AND lease_expires_at > now()
    RETURNING run_id
),
{_CLOSE_ATTEMPT}
SELECT run_id FROM finished""",  # noqa: S608
)

# queue: the oldest queue entry is locked (SKIP LOCKED) and deleted, its run claimed by key;
# completion frees the thread's slot in agent_run_active.
QUEUE: Final = Statements(
    claim=f"""\
WITH candidate AS (
    SELECT created_at, run_id FROM agent_run_queue
    ORDER BY created_at, run_id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
dequeued AS (
    DELETE FROM agent_run_queue q
    USING candidate c
    WHERE q.created_at = c.created_at AND q.run_id = c.run_id
    RETURNING q.run_id
),
claimed AS (
    UPDATE agent_runs r
    SET status = 'running', worker_id = %(worker_id)s::text, heartbeat_at = now(),
        lease_expires_at = {_LEASE}, started_at = now(), updated_at = now()
    FROM dequeued
    WHERE r.id = dequeued.run_id AND r.status = 'pending'
    RETURNING r.id, r.heartbeat_at, r.lease_expires_at
),
{_OPEN_ATTEMPT}""",  # noqa: S608
    renew=f"""\
WITH renewed AS (
    UPDATE agent_runs
    SET heartbeat_at = now(), lease_expires_at = {_LEASE}, updated_at = now()
    WHERE id = %(run_id)s::text AND worker_id = %(worker_id)s::text AND lease_expires_at > now()
    RETURNING id AS run_id, lease_expires_at
),
{_RENEW_ATTEMPT}""",  # noqa: S608
    complete=f"""\
WITH finished AS (
    UPDATE agent_runs
    SET status = 'completed', finished_at = now(), worker_id = NULL, heartbeat_at = NULL,
        lease_expires_at = NULL, updated_at = now()
    WHERE id = %(run_id)s::text AND worker_id = %(worker_id)s::text AND status = 'running'
      AND lease_expires_at > now()
    RETURNING id, uid, agent_slug, thread_id
),
{_CLOSE_ATTEMPT},
released AS (
    DELETE FROM agent_run_active a
    USING finished f
    WHERE a.uid = f.uid AND a.agent_slug = f.agent_slug AND a.thread_id = f.thread_id
      AND a.run_id = f.id
)
SELECT id FROM finished""",  # noqa: S608
)

LEAN_PLUS_CHECKS: Final = Statements(
    claim=lean_floor.CLAIM.replace("bench_lean.", ""),
    renew=lean_floor.RENEW.replace("bench_lean.", ""),
    complete=lean_floor.COMPLETE.replace("bench_lean.", ""),
)


class NamedStatementsClient:
    """Three statements with named parameters over one autocommit connection, prepared."""

    def __init__(self, conn: psycopg.Connection[Any], statements: Statements) -> None:
        if not conn.autocommit:
            raise ValueError("the floor runs each statement as its own autocommit transaction")
        self.conn = conn
        self._statements = statements
        self._cur = conn.cursor()

    def _scalar(self, sql: LiteralString, params: dict[str, Any]) -> Any:
        row = self._cur.execute(sql, params, prepare=True).fetchone()
        return None if row is None else row[0]

    def claim(self, worker_id: str, lease_seconds: float) -> str | None:
        run_id = self._scalar(
            self._statements.claim, {"worker_id": worker_id, "lease": lease_seconds}
        )
        return None if run_id is None else str(run_id)

    def renew(self, run_id: str, worker_id: str, lease_seconds: float) -> bool:
        params = {"run_id": run_id, "worker_id": worker_id, "lease": lease_seconds}
        return self._scalar(self._statements.renew, params) is not None

    def complete(self, run_id: str, worker_id: str) -> bool:
        params = {"run_id": run_id, "worker_id": worker_id}
        return self._scalar(self._statements.complete, params) is not None


# History: every design but lean and lean_plus_checks copies the finished runs bench.seed wrote
# into `current` (public), so all hold the same 10,000 runs and attempts.
_ATTEMPT_COPY_COLUMNS: Final = (
    "run_id, attempt_no, worker_id, started_at, heartbeat_at, lease_expires_at, finished_at,"
    " outcome, error_type, error_message, created_at, updated_at"
)
_COPY_ATTEMPTS: Final = f"""\
INSERT INTO agent_run_attempts ({_ATTEMPT_COPY_COLUMNS})
SELECT {_ATTEMPT_COPY_COLUMNS} FROM public.agent_run_attempts ORDER BY id"""  # noqa: S608
_RUN_COLUMNS: Final = (
    "id, request_id, thread_id, agent_slug, uid, run_type, created_by_run_id, status,"
    " input_payload, error_type, error_message, worker_id, heartbeat_at, lease_expires_at,"
    " manifest, manifest_fingerprint, manifest_recorded_at, started_at, finished_at,"
    " created_at, updated_at, trace_context"
)
_IMMUTABLE_COLUMNS: Final = (
    "id, request_id, thread_id, agent_slug, uid, run_type, created_by_run_id, input_payload,"
    " created_at, trace_context"
)
_STATE_COLUMNS: Final = (
    "uid, agent_slug, thread_id, created_at, error_type, error_message, manifest,"
    " manifest_fingerprint, manifest_recorded_at, finished_at, status, started_at, worker_id,"
    " heartbeat_at, lease_expires_at, updated_at"
)
COPY_ONE_ROW_HISTORY: Final = f"""\
INSERT INTO agent_runs ({_RUN_COLUMNS})
SELECT {_RUN_COLUMNS} FROM public.agent_runs ORDER BY created_at, id;
{_COPY_ATTEMPTS}"""  # noqa: S608
COPY_SPLIT_HISTORY: Final = f"""\
INSERT INTO agent_runs ({_IMMUTABLE_COLUMNS})
SELECT {_IMMUTABLE_COLUMNS} FROM public.agent_runs ORDER BY created_at, id;
INSERT INTO agent_run_state (run_id, {_STATE_COLUMNS})
SELECT id, {_STATE_COLUMNS} FROM public.agent_runs ORDER BY created_at, id;
{_COPY_ATTEMPTS}"""  # noqa: S608
COPY_LEAN_HISTORY: Final = (
    "INSERT INTO runs OVERRIDING SYSTEM VALUE SELECT * FROM bench_lean.runs ORDER BY id;\n"
    "SELECT setval(pg_get_serial_sequence('runs', 'id'), (SELECT max(id) FROM runs));\n"
    "INSERT INTO attempts SELECT * FROM bench_lean.attempts"
)

# Pending runs as bench.seed writes them, for the split designs: the immutable row and its
# state row in one statement. Parameters: tag, count.
SPLIT_PENDING: Final = """\
WITH runs AS (
    INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, input_payload,
                            created_at)
    SELECT left(md5(%(tag)s), 8) || '-0000-7000-8000-' || lpad(to_hex(i), 12, '0'),
           %(tag)s || '-p-' || lpad(i::text, 9, '0'),
           %(tag)s || '-thread-' || i,
           'agent-' || mod(i, 4),
           'user-' || mod(i, 101),
           jsonb_build_object('prompt', 'seeded pending run ' || i, 'max_tokens', mod(i, 4096)),
           clock_timestamp()
    FROM generate_series(1, %(count)s::int) AS i
    RETURNING id, uid, agent_slug, thread_id, created_at
)
INSERT INTO agent_run_state (run_id, uid, agent_slug, thread_id, created_at)
SELECT id, uid, agent_slug, thread_id, created_at FROM runs"""

# After bench.seed's pending runs: their queue entries and thread slots, as a create writes them.
QUEUE_ENLIST: Final = """\
WITH fresh AS (
    SELECT r.id, r.created_at, r.uid, r.agent_slug, r.thread_id FROM agent_runs r
    WHERE r.status = 'pending'
      AND NOT EXISTS (SELECT FROM agent_run_queue q
                      WHERE q.created_at = r.created_at AND q.run_id = r.id)
),
queued AS (
    INSERT INTO agent_run_queue (created_at, run_id) SELECT created_at, id FROM fresh
)
INSERT INTO agent_run_active (uid, agent_slug, thread_id, run_id)
SELECT uid, agent_slug, thread_id, id FROM fresh"""

LEAN_PLUS_CHECKS_PENDING: Final = """\
INSERT INTO runs (created_at, request_id, thread_id, agent_slug, uid, input_payload)
SELECT clock_timestamp(),
       %(tag)s || '-p-' || lpad(i::text, 9, '0'),
       %(tag)s || '-thread-' || i,
       'agent-' || mod(i, 4),
       'user-' || mod(i, 101),
       jsonb_build_object('prompt', 'seeded pending run ' || i, 'max_tokens', mod(i, 4096))
FROM generate_series(1, %(count)s::int) AS i"""

_tags = itertools.count(1)


def new_tag() -> str:
    return f"design{next(_tags)}"
