-- reconcile_expired_leases, step 2 of 2 (SPEC 3): converge the runs step 1 locked. This is a
-- new statement, so its snapshot sees every attempt committed before the locks were taken.
-- Each run -> failed / worker_lease_expired with an at-least-once message, lease cleared; every
-- attempt still open -> lease_expired / worker_lease_expired. Finished attempts are only read.
-- Returns the converged runs as they are now. Each one notifies agent_runs_finished with its
-- id, delivered at commit (`notified` is read by the final SELECT: a CTE nobody reads is never
-- executed).
-- Statuses are tested in a CASE, never as `status IN (...)` next to the id lookup: the planner
-- would take such a test for the predicate of the partial indexes over active runs, and after a
-- quiet ANALYZE (those indexes then look empty) walk one of them for a single id.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
converged AS (
    UPDATE agent_runs r
    SET status = 'failed',
        error_type = 'worker_lease_expired',
        error_message = %(lost_message)s::text,
        finished_at = clock.now,
        worker_id = NULL,
        heartbeat_at = NULL,
        lease_expires_at = NULL,
        updated_at = clock.now
    FROM clock
    WHERE r.id = ANY (%(run_ids)s::text[])
      AND CASE r.status WHEN 'running' THEN true WHEN 'cancel_requested' THEN true END
    RETURNING r.*
),
attempts AS (
    UPDATE agent_run_attempts a
    SET finished_at = clock.now,
        outcome = 'lease_expired',
        error_type = 'worker_lease_expired',
        error_message = %(lost_message)s::text,
        updated_at = clock.now
    FROM converged, clock
    WHERE a.run_id = ANY (%(run_ids)s::text[]) AND a.run_id = converged.id
      AND a.finished_at IS NULL
    RETURNING a.id
),
notified AS (
    SELECT pg_notify('agent_runs_finished', converged.id) FROM converged
)
SELECT converged.* FROM converged
WHERE (SELECT count(*) FROM notified) >= 0
ORDER BY converged.id
