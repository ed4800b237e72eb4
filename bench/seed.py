"""Bulk seeding with INSERT … SELECT generate_series: history, backlogs and expired leases.

Rows are shaped like the repository's own (check constraints and the attempts trigger apply):
finished runs carry their finished attempts (one in ten failed after a retry, so two attempts),
pending runs carry none, expired leases are running runs with an open attempt.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, LiteralString

import psycopg

_batch_ids = itertools.count(1)

# Finished history: created over the last 30 days, each with its attempts. Parameters: tag,
# first, last, count.
_HISTORY: Final[LiteralString] = """\
WITH span AS (
    SELECT now() - interval '30 days' AS start, interval '29 days' / %(count)s AS step
),
runs AS (
    INSERT INTO agent_runs (
        id, request_id, thread_id, agent_slug, uid, status, input_payload, error_type,
        error_message, started_at, finished_at, created_at, updated_at
    )
    SELECT left(md5(%(tag)s), 8) || '-0000-7000-8000-' || lpad(to_hex(i), 12, '0'),
           %(tag)s || '-h-' || lpad(i::text, 9, '0'),
           'thread-' || mod(i, 997),
           'agent-' || mod(i, 4),
           'user-' || mod(i, 101),
           CASE WHEN mod(i, 10) = 0 THEN 'failed' ELSE 'completed' END,
           jsonb_build_object('prompt', 'seeded history run ' || i, 'max_tokens', mod(i, 4096)),
           CASE WHEN mod(i, 10) = 0 THEN 'agent_error' END,
           CASE WHEN mod(i, 10) = 0 THEN 'the agent raised: seeded failure ' || i END,
           span.start + i * span.step + interval '1 second',
           span.start + i * span.step + interval '30 seconds',
           span.start + i * span.step,
           span.start + i * span.step + interval '30 seconds'
    FROM generate_series(%(first)s::int, %(last)s::int) AS i, span
    RETURNING id, status, error_type, error_message, started_at, finished_at
),
retried AS (
    INSERT INTO agent_run_attempts (
        run_id, attempt_no, worker_id, started_at, heartbeat_at, lease_expires_at, finished_at,
        outcome, created_at, updated_at
    )
    SELECT id, 1, 'seed-worker:' || left(md5(id), 16), started_at,
           started_at + interval '5 seconds', started_at + interval '65 seconds',
           started_at + interval '8 seconds', 'retry_released',
           started_at, started_at + interval '8 seconds'
    FROM runs WHERE status = 'failed'
)
INSERT INTO agent_run_attempts (
    run_id, attempt_no, worker_id, started_at, heartbeat_at, lease_expires_at, finished_at,
    outcome, error_type, error_message, created_at, updated_at
)
SELECT id, CASE WHEN status = 'failed' THEN 2 ELSE 1 END,
       'seed-worker:' || left(md5(id || 'x'), 16),
       started_at + interval '10 seconds', finished_at - interval '1 second',
       finished_at + interval '59 seconds', finished_at, status, error_type, error_message,
       started_at + interval '10 seconds', finished_at
FROM runs"""

# A pending backlog, oldest first, created just before now (after every earlier batch when
# `age` is zero). Parameters: tag, first, last, age.
_PENDING: Final[LiteralString] = """\
INSERT INTO agent_runs (id, request_id, thread_id, agent_slug, uid, input_payload, created_at,
                        updated_at)
SELECT left(md5(%(tag)s), 8) || '-0000-7000-8000-' || lpad(to_hex(i), 12, '0'),
       %(tag)s || '-p-' || lpad(i::text, 9, '0'),
       %(tag)s || '-thread-' || i,
       'agent-' || mod(i, 4),
       'user-' || mod(i, 101),
       jsonb_build_object('prompt', 'seeded pending run ' || i, 'max_tokens', mod(i, 4096)),
       clock_timestamp() - %(age)s::interval,
       now()
FROM generate_series(%(first)s::int, %(last)s::int) AS i"""

# Runs whose owner vanished: running, lease expired a while ago, attempt still open.
# Parameters: tag, count.
_EXPIRED: Final[LiteralString] = """\
WITH runs AS (
    INSERT INTO agent_runs (
        id, request_id, thread_id, agent_slug, uid, status, worker_id, heartbeat_at,
        lease_expires_at, started_at, created_at, updated_at
    )
    SELECT gen_random_uuid()::text,
           %(tag)s || '-x-' || i,
           %(tag)s || '-thread-' || i,
           'agent-' || mod(i, 4),
           'user-' || mod(i, 101),
           'running',
           'lost-worker-' || mod(i, 16) || ':' || md5(%(tag)s || i),
           now() - interval '20 minutes' + i * interval '10 milliseconds',
           now() - interval '19 minutes' + i * interval '10 milliseconds',
           now() - interval '30 minutes',
           now() - interval '31 minutes',
           now() - interval '20 minutes'
    FROM generate_series(1, %(count)s::int) AS i
    RETURNING id, worker_id, started_at, heartbeat_at, lease_expires_at
)
INSERT INTO agent_run_attempts (
    run_id, attempt_no, worker_id, started_at, heartbeat_at, lease_expires_at, created_at,
    updated_at
)
SELECT id, 1, worker_id, started_at, heartbeat_at, lease_expires_at, started_at, heartbeat_at
FROM runs"""

CHUNK: Final = 100_000

Conn = psycopg.Connection[Any]


def _tag(prefix: str) -> str:
    return f"{prefix}{next(_batch_ids)}"


def _chunked(conns: Sequence[Conn], sql: LiteralString, count: int, params: dict[str, Any]) -> None:
    """Run `sql` over [1, count] in chunks of CHUNK rows, spread over the given connections."""
    ranges = [(first, min(first + CHUNK - 1, count)) for first in range(1, count + 1, CHUNK)]
    if len(conns) == 1 or len(ranges) == 1:
        for first, last in ranges:
            conns[0].execute(sql, {**params, "first": first, "last": last})
        return

    def worker(index: int) -> None:
        for first, last in ranges[index :: len(conns)]:
            conns[index].execute(sql, {**params, "first": first, "last": last})

    with ThreadPoolExecutor(max_workers=len(conns)) as pool:
        for future in [pool.submit(worker, i) for i in range(len(conns))]:
            future.result()


def seed_history(conns: Sequence[Conn], count: int) -> None:
    """`count` finished runs (completed, one in ten failed) with their finished attempts."""
    _chunked(conns, _HISTORY, count, {"tag": _tag("h"), "count": count})


def seed_pending(conns: Sequence[Conn], count: int, *, age_seconds: float = 0.0) -> None:
    """`count` pending runs, queued after every run seeded before (FIFO by created_at, id)."""
    _chunked(conns, _PENDING, count, {"tag": _tag("p"), "age": f"{age_seconds} seconds"})


def seed_expired_leases(conn: psycopg.Connection[Any], count: int) -> None:
    """`count` running runs whose lease expired long ago, each with its attempt still open."""
    conn.execute(_EXPIRED, {"tag": _tag("x"), "count": count})


def count_pending(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM agent_runs WHERE status = 'pending'").fetchone()
    return int(row[0]) if row else 0
