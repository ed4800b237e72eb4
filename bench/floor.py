"""The floor: the same lifecycle as hand-minimal SQL, one prepared autocommit statement each.

Each transition is a single data-modifying CTE that writes the run and its attempt together, as
one implicit transaction (no BEGIN/COMMIT), and returns only what the caller needs. It does what
this benchmark's workload needs and nothing more: no "missing vs refused" row, no convergence of
a stale open attempt, no Python model building. It is the physical limit the repository is
measured against, on the same schema and the same server.
"""

from __future__ import annotations

from typing import Any, Final, LiteralString

import psycopg

from agent_runs.transport import Channel, Statement

# Parameters: worker_id, lease_seconds, worker_id. The oldest pending run, read in
# ix_agent_runs_claimable order (status = 'pending' implies the index predicate), locked with
# SKIP LOCKED; its attempt (max + 1) opens in the same statement.
CLAIM: Final[LiteralString] = """\
WITH candidate AS (
    SELECT id FROM agent_runs
    WHERE status = 'pending'
    ORDER BY created_at, id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
claimed AS (
    UPDATE agent_runs r
    SET status = 'running', worker_id = %s::text, heartbeat_at = now(),
        lease_expires_at = now() + make_interval(secs => %s::float8), started_at = now(),
        updated_at = now()
    FROM candidate
    WHERE r.id = candidate.id
    RETURNING r.id, r.heartbeat_at, r.lease_expires_at
),
opened AS (
    INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, heartbeat_at,
                                    lease_expires_at)
    SELECT id,
           coalesce((SELECT max(attempt_no) FROM agent_run_attempts WHERE run_id = claimed.id),
                    0) + 1,
           %s::text, heartbeat_at, heartbeat_at, lease_expires_at
    FROM claimed
)
SELECT id FROM claimed"""

# Parameters: lease_seconds, run_id, worker_id, run_id. The owner's live lease moves forward on
# the run and its open attempt (found by run id: an index lookup).
RENEW: Final[LiteralString] = """\
WITH renewed AS (
    UPDATE agent_runs
    SET heartbeat_at = now(), lease_expires_at = now() + make_interval(secs => %s::float8),
        updated_at = now()
    WHERE id = %s::text AND worker_id = %s::text AND lease_expires_at > now()
    RETURNING id, status, lease_expires_at
),
attempt AS (
    UPDATE agent_run_attempts a
    SET heartbeat_at = now(), lease_expires_at = renewed.lease_expires_at, updated_at = now()
    FROM renewed
    WHERE a.run_id = %s::text AND a.finished_at IS NULL
)
SELECT status FROM renewed"""

# Parameters: run_id, worker_id, run_id. The owner finishes the run and its open attempt (found
# by run id); lease cleared.
COMPLETE: Final[LiteralString] = """\
WITH finished AS (
    UPDATE agent_runs
    SET status = 'completed', finished_at = now(), worker_id = NULL, heartbeat_at = NULL,
        lease_expires_at = NULL, updated_at = now()
    WHERE id = %s::text AND worker_id = %s::text AND status = 'running'
      AND lease_expires_at > now()
    RETURNING id
),
attempt AS (
    UPDATE agent_run_attempts a
    SET finished_at = now(), outcome = 'completed', updated_at = now()
    FROM finished
    WHERE a.run_id = %s::text AND a.finished_at IS NULL
)
SELECT id FROM finished"""


class FloorClient:
    """The three floor statements over one autocommit connection, prepared on first use."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        if not conn.autocommit:
            raise ValueError("the floor runs each statement as its own autocommit transaction")
        self.conn = conn
        self._cur = conn.cursor()

    def _scalar(self, sql: LiteralString, params: tuple[Any, ...]) -> Any:
        row = self._cur.execute(sql, params, prepare=True).fetchone()
        return None if row is None else row[0]

    def claim(self, worker_id: str, lease_seconds: float) -> str | None:
        run_id = self._scalar(CLAIM, (worker_id, lease_seconds, worker_id))
        return None if run_id is None else str(run_id)

    def renew(self, run_id: str, worker_id: str, lease_seconds: float) -> bool:
        return self._scalar(RENEW, (lease_seconds, run_id, worker_id, run_id)) is not None

    def complete(self, run_id: str, worker_id: str) -> bool:
        return self._scalar(COMPLETE, (run_id, worker_id, run_id)) is not None


def _numbered(sql: LiteralString) -> str:
    """%s placeholders as $1, $2, … in order, for a server-side PREPARE."""
    parts = sql.split("%s")
    out = parts[0]
    for number, part in enumerate(parts[1:], start=1):
        out += f"${number}{part}"
    return out


class FloorInTransactionClient:
    """A diagnostic, not the floor: the floor's statements through the repository's transport.

    Each statement in its own BEGIN … COMMIT, one round trip (agent_runs.transport.Channel):
    its ratio to the floor is what an explicit transaction per transition costs by
    itself; what remains between it and the repository is the repository's own work (its
    rules, its full rows, its Python).
    """

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        if not conn.autocommit:
            raise ValueError("the transaction wrapper needs an autocommit connection")
        self.conn = conn
        self._channel = Channel(conn)
        self._statements = {
            name: Statement(name=f"floor_{name}", sql=_numbered(sql), params=params)
            for name, sql, params in (
                ("claim", CLAIM, ("worker_id", "lease_seconds", "worker_id_again")),
                ("renew", RENEW, ("lease_seconds", "run_id", "worker_id", "run_id_again")),
                ("complete", COMPLETE, ("run_id", "worker_id", "run_id_again")),
            )
        }

    def _scalar(self, name: str, params: tuple[Any, ...]) -> Any:
        rows = self._channel.execute(self._statements[name], params)
        if rows is None:
            raise RuntimeError("the floor's connection is not free for its own transactions")
        return rows[0].values[0] if rows else None

    def claim(self, worker_id: str, lease_seconds: float) -> str | None:
        run_id = self._scalar("claim", (worker_id, lease_seconds, worker_id))
        return None if run_id is None else str(run_id)

    def renew(self, run_id: str, worker_id: str, lease_seconds: float) -> bool:
        return self._scalar("renew", (lease_seconds, run_id, worker_id, run_id)) is not None

    def complete(self, run_id: str, worker_id: str) -> bool:
        return self._scalar("complete", (run_id, worker_id, run_id)) is not None
