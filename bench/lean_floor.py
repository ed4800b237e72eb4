"""The lean floor: the lifecycle as a hand-written system would store it, in its own schema.

The same five statements per lifecycle as bench.floor (claim, three renewals, complete: each one
prepared autocommit statement writing the run and its attempt together), over a schema that holds
the same facts with nothing else. It is the floor WAL per lifecycle is measured against; the
same-schema floor (bench.floor) shows what the repository's statements cost on the repository's
own schema.

The schema, `bench_lean` in the benchmark's main database, and the choices made:

- runs: `id bigint GENERATED ALWAYS AS IDENTITY` (8 bytes, ever increasing: inserts always go to
  the right edge of the key index, and each index entry is half a uuid's); a primary key and the
  FIFO claim index `(created_at, id) WHERE status = 'pending'`, nothing else. The run's content
  (request, thread, agent, user, input) is stored as the repository stores it, so rows are as
  wide, but nothing indexes it: no idempotency key, no one-active-run-per-thread rule, no index
  of live runs. `status` is text with no CHECK.
- attempts: keyed as they are read, `PRIMARY KEY (run_id, attempt_no)`: no surrogate id, no
  second index. No "one open attempt per run" index: the floor opens an attempt only in the
  statement that claims a pending run under its row lock, so the rule holds by construction,
  and closing an attempt stays a HOT update (nothing indexed changes). No foreign key to runs
  (its check locks the run row once more per claim), no trigger, no CHECK.
- Columns that change together sit together at the end of each row (status, owner, start and
  finish, then heartbeat and lease last): PostgreSQL logs only the changed middle of a tuple
  updated on its page, so a renewal logs the two lease timestamps. No `updated_at`, no
  `created_at` on attempts (an attempt's `started_at` says when it was created).
- fillfactor 80 on both tables, as the repository's: room on the page keeps updates HOT, and
  tuning is not what the floor is about.
"""

from __future__ import annotations

import itertools
from typing import Any, Final, LiteralString

import psycopg

SCHEMA: Final = "bench_lean"
TABLES: Final = (f"{SCHEMA}.runs", f"{SCHEMA}.attempts")

DDL: Final[LiteralString] = """\
CREATE SCHEMA bench_lean;
CREATE TABLE bench_lean.runs (
    id               bigint      GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    created_at       timestamptz NOT NULL DEFAULT now(),
    request_id       text        NOT NULL,
    thread_id        text        NOT NULL,
    agent_slug       text        NOT NULL,
    uid              text        NOT NULL,
    input_payload    jsonb       NOT NULL,
    status           text        NOT NULL DEFAULT 'pending',
    worker_id        text,
    started_at       timestamptz,
    finished_at      timestamptz,
    heartbeat_at     timestamptz,
    lease_expires_at timestamptz
) WITH (fillfactor = 80);
CREATE INDEX runs_claimable ON bench_lean.runs (created_at, id) WHERE status = 'pending';
CREATE TABLE bench_lean.attempts (
    run_id           bigint      NOT NULL,
    attempt_no       integer     NOT NULL,
    worker_id        text        NOT NULL,
    started_at       timestamptz NOT NULL,
    error_type       text,
    error_message    text,
    outcome          text,
    finished_at      timestamptz,
    heartbeat_at     timestamptz,
    lease_expires_at timestamptz,
    PRIMARY KEY (run_id, attempt_no)
) WITH (fillfactor = 80);
"""

# The same content as bench.seed's pending runs. Parameters: tag, count, age.
_PENDING: Final[LiteralString] = """\
INSERT INTO bench_lean.runs (created_at, request_id, thread_id, agent_slug, uid, input_payload)
SELECT clock_timestamp() - %(age)s::interval,
       %(tag)s || '-p-' || lpad(i::text, 9, '0'),
       %(tag)s || '-thread-' || i,
       'agent-' || mod(i, 4),
       'user-' || mod(i, 101),
       jsonb_build_object('prompt', 'seeded pending run ' || i, 'max_tokens', mod(i, 4096))
FROM generate_series(1, %(count)s::int) AS i"""

# Finished history as bench.seed writes it: one in ten failed after a retry (two attempts).
# Parameters: tag, count.
_HISTORY: Final[LiteralString] = """\
WITH span AS (
    SELECT now() - interval '30 days' AS start, interval '29 days' / %(count)s AS step
),
runs AS (
    INSERT INTO bench_lean.runs (created_at, request_id, thread_id, agent_slug, uid,
                                 input_payload, status, started_at, finished_at)
    SELECT span.start + i * span.step,
           %(tag)s || '-h-' || lpad(i::text, 9, '0'),
           'thread-' || mod(i, 997),
           'agent-' || mod(i, 4),
           'user-' || mod(i, 101),
           jsonb_build_object('prompt', 'seeded history run ' || i, 'max_tokens', mod(i, 4096)),
           CASE WHEN mod(i, 10) = 0 THEN 'failed' ELSE 'completed' END,
           span.start + i * span.step + interval '1 second',
           span.start + i * span.step + interval '30 seconds'
    FROM generate_series(1, %(count)s::int) AS i, span
    RETURNING id, status, started_at, finished_at
),
retried AS (
    INSERT INTO bench_lean.attempts (run_id, attempt_no, worker_id, started_at, outcome,
                                     finished_at, heartbeat_at, lease_expires_at)
    SELECT id, 1, 'seed-worker:' || id, started_at, 'retry_released',
           started_at + interval '8 seconds', started_at + interval '5 seconds',
           started_at + interval '65 seconds'
    FROM runs WHERE status = 'failed'
)
INSERT INTO bench_lean.attempts (run_id, attempt_no, worker_id, started_at, error_type,
                                 error_message, outcome, finished_at, heartbeat_at,
                                 lease_expires_at)
SELECT id, CASE WHEN status = 'failed' THEN 2 ELSE 1 END, 'seed-worker:' || id || 'x',
       started_at + interval '10 seconds',
       CASE WHEN status = 'failed' THEN 'agent_error' END,
       CASE WHEN status = 'failed' THEN 'the agent raised: seeded failure ' || id END,
       status, finished_at, finished_at - interval '1 second', finished_at + interval '59 seconds'
FROM runs"""

# Parameters: worker_id, lease_seconds. The oldest pending run, locked with SKIP LOCKED; its
# attempt (max + 1, read through the primary key) opens in the same statement.
CLAIM: Final[LiteralString] = """\
WITH candidate AS (
    SELECT id FROM bench_lean.runs
    WHERE status = 'pending'
    ORDER BY created_at, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
claimed AS (
    UPDATE bench_lean.runs r
    SET status = 'running', worker_id = %(worker_id)s::text, started_at = now(),
        heartbeat_at = now(), lease_expires_at = now() + make_interval(secs => %(lease)s::float8)
    FROM candidate
    WHERE r.id = candidate.id
    RETURNING r.id, r.heartbeat_at, r.lease_expires_at
),
opened AS (
    INSERT INTO bench_lean.attempts (run_id, attempt_no, worker_id, started_at, heartbeat_at,
                                     lease_expires_at)
    SELECT id,
           coalesce((SELECT max(attempt_no) FROM bench_lean.attempts WHERE run_id = claimed.id),
                    0) + 1,
           %(worker_id)s::text, heartbeat_at, heartbeat_at, lease_expires_at
    FROM claimed
)
SELECT id FROM claimed"""

# Parameters: lease_seconds, run_id, worker_id. The owner's live lease moves forward on the run
# and its open attempt.
RENEW: Final[LiteralString] = """\
WITH renewed AS (
    UPDATE bench_lean.runs
    SET heartbeat_at = now(), lease_expires_at = now() + make_interval(secs => %(lease)s::float8)
    WHERE id = %(run_id)s::bigint AND worker_id = %(worker_id)s::text AND lease_expires_at > now()
    RETURNING id, lease_expires_at
),
attempt AS (
    UPDATE bench_lean.attempts a
    SET heartbeat_at = now(), lease_expires_at = renewed.lease_expires_at
    FROM renewed
    WHERE a.run_id = %(run_id)s::bigint AND a.finished_at IS NULL
)
SELECT id FROM renewed"""

# Parameters: run_id, worker_id. The owner finishes the run and its open attempt; lease cleared.
COMPLETE: Final[LiteralString] = """\
WITH finished AS (
    UPDATE bench_lean.runs
    SET status = 'completed', worker_id = NULL, finished_at = now(), heartbeat_at = NULL,
        lease_expires_at = NULL
    WHERE id = %(run_id)s::bigint AND worker_id = %(worker_id)s::text AND status = 'running'
      AND lease_expires_at > now()
    RETURNING id
),
attempt AS (
    UPDATE bench_lean.attempts a
    SET outcome = 'completed', finished_at = now()
    FROM finished
    WHERE a.run_id = %(run_id)s::bigint AND a.finished_at IS NULL
)
SELECT id FROM finished"""

_batch_ids = itertools.count(1)


def _tag() -> str:
    return f"lean{next(_batch_ids)}"


def install(conn: psycopg.Connection[Any]) -> None:
    """Create the lean schema in the connection's database (once)."""
    conn.execute(DDL)


def seed_pending(conn: psycopg.Connection[Any], count: int, *, age_seconds: float = 0.0) -> None:
    """`count` pending runs, queued after every run seeded before."""
    conn.execute(_PENDING, {"tag": _tag(), "count": count, "age": f"{age_seconds} seconds"})


def seed_history(conn: psycopg.Connection[Any], count: int) -> None:
    """`count` finished runs with their finished attempts, then VACUUM ANALYZE."""
    if count:
        conn.execute(_HISTORY, {"tag": _tag(), "count": count})
    conn.execute("VACUUM (ANALYZE) bench_lean.runs")
    conn.execute("VACUUM (ANALYZE) bench_lean.attempts")


def count_pending(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM bench_lean.runs WHERE status = 'pending'").fetchone()
    return int(row[0]) if row else 0


class LeanFloorClient:
    """The three lean statements over one autocommit connection, prepared on first use."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        if not conn.autocommit:
            raise ValueError("the floor runs each statement as its own autocommit transaction")
        self.conn = conn
        self._cur = conn.cursor()

    def _scalar(self, sql: LiteralString, params: dict[str, Any]) -> Any:
        row = self._cur.execute(sql, params, prepare=True).fetchone()
        return None if row is None else row[0]

    def claim(self, worker_id: str, lease_seconds: float) -> str | None:
        run_id = self._scalar(CLAIM, {"worker_id": worker_id, "lease": lease_seconds})
        return None if run_id is None else str(run_id)

    def renew(self, run_id: str, worker_id: str, lease_seconds: float) -> bool:
        params = {"run_id": run_id, "worker_id": worker_id, "lease": lease_seconds}
        return self._scalar(RENEW, params) is not None

    def complete(self, run_id: str, worker_id: str) -> bool:
        return self._scalar(COMPLETE, {"run_id": run_id, "worker_id": worker_id}) is not None
