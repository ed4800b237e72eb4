-- renew_lease (SPEC 3): only the owner of a running/cancel_requested run whose lease is still
-- live (lease_expires_at > now) moves the run's and its open attempt's heartbeat and lease
-- forward. Otherwise nothing is written. Touches no indexed column, so both updates can be HOT.
-- Returns the run's status when renewed (so a cancel request is seen), no row otherwise.
-- now = coalesce(%(now)s, now()): the given clock, else the transaction's.
-- Statuses are tested in a CASE, never as `status IN (...)` next to the id lookup: the planner
-- would take such a test for the predicate of the partial indexes over active runs, and after a
-- quiet ANALYZE (those indexes then look empty) walk one of them for a single id.
WITH renewed AS (
    UPDATE agent_runs r
    SET heartbeat_at = coalesce(%(now)s::timestamptz, now()),
        lease_expires_at = coalesce(%(now)s::timestamptz, now())
                           + make_interval(secs => %(lease_seconds)s::float8),
        updated_at = coalesce(%(now)s::timestamptz, now())
    WHERE r.id = %(run_id)s
      AND r.worker_id = %(worker_id)s::text
      AND CASE r.status WHEN 'running' THEN true WHEN 'cancel_requested' THEN true END
      AND r.lease_expires_at > coalesce(%(now)s::timestamptz, now())
    RETURNING r.status, r.heartbeat_at, r.lease_expires_at
),
attempt AS (
    UPDATE agent_run_attempts a
    SET heartbeat_at = renewed.heartbeat_at,
        lease_expires_at = renewed.lease_expires_at,
        updated_at = renewed.heartbeat_at
    FROM renewed
    -- By the run_id parameter: an index lookup of the one open attempt.
    WHERE a.run_id = %(run_id)s AND a.finished_at IS NULL AND a.worker_id = %(worker_id)s::text
    RETURNING a.id
)
SELECT status FROM renewed
