-- renew_leases (issue 4): renew_lease for many (run_id, worker_id) leases in one statement, with
-- the same rule per lease: only the owner of a running/cancel_requested run whose lease is live.
-- Rows are locked in id order, so two batches can never deadlock. Returns (id, status) of the
-- runs renewed; a refused lease is simply absent.
-- Statuses are tested in a CASE, never as `status IN (...)` next to the id lookup: the planner
-- would take such a test for the predicate of the partial indexes over active runs, and after a
-- quiet ANALYZE (those indexes then look empty) walk one of them for a single id.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
leases AS (
    SELECT * FROM unnest(%(run_ids)s::text[], %(worker_ids)s::text[]) AS l (run_id, worker_id)
),
locked AS (
    SELECT r.id
    FROM agent_runs r
    JOIN leases l ON l.run_id = r.id AND l.worker_id = r.worker_id
    CROSS JOIN clock
    WHERE r.id = ANY (%(run_ids)s::text[])  -- index lookups, never a walk over live runs
      AND CASE r.status WHEN 'running' THEN true WHEN 'cancel_requested' THEN true END
      AND r.lease_expires_at > clock.now
    ORDER BY r.id
    FOR UPDATE OF r
),
renewed AS (
    UPDATE agent_runs r
    SET heartbeat_at = clock.now,
        lease_expires_at = clock.now + make_interval(secs => %(lease_seconds)s::float8),
        updated_at = clock.now
    FROM locked, clock
    WHERE r.id = locked.id
    RETURNING r.id, r.status, r.worker_id, r.heartbeat_at, r.lease_expires_at
),
attempts AS (
    UPDATE agent_run_attempts a
    SET heartbeat_at = renewed.heartbeat_at,
        lease_expires_at = renewed.lease_expires_at,
        updated_at = renewed.heartbeat_at
    FROM renewed
    WHERE a.run_id = ANY (%(run_ids)s::text[]) AND a.run_id = renewed.id
      AND a.finished_at IS NULL AND a.worker_id = renewed.worker_id
    RETURNING a.id
)
SELECT id, status FROM renewed
