-- release_lease_for_retry (SPEC 3): only the owner of a running run with a live lease.
-- running -> pending, lease cleared; the owner's open attempt finishes as retry_released and
-- stays as a fact. The next claim opens attempt n + 1. Returns one row when released.
-- A release wakes the workers: NOTIFY agent_runs_claimable with the run's agent_slug, delivered
-- at commit (`notified` is read by the final SELECT: a CTE nobody reads is never executed).
-- Statuses are tested in a CASE, never as `status IN (...)` next to the id lookup: the planner
-- would take such a test for the predicate of the partial indexes over active runs, and after a
-- quiet ANALYZE (those indexes then look empty) walk one of them for a single id.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
released AS (
    UPDATE agent_runs r
    SET status = 'pending',
        worker_id = NULL,
        heartbeat_at = NULL,
        lease_expires_at = NULL,
        updated_at = clock.now
    FROM clock
    WHERE r.id = %(run_id)s
      AND CASE r.status WHEN 'running' THEN true END
      AND r.worker_id = %(worker_id)s::text
      AND r.lease_expires_at > clock.now
    RETURNING r.id, r.agent_slug
),
finished AS (
    UPDATE agent_run_attempts a
    SET finished_at = clock.now,
        outcome = 'retry_released',
        updated_at = clock.now
    FROM released, clock
    WHERE a.run_id = %(run_id)s AND a.run_id = released.id AND a.finished_at IS NULL
      AND a.worker_id = %(worker_id)s::text
    RETURNING a.id
),
notified AS (
    SELECT pg_notify('agent_runs_claimable', released.agent_slug) FROM released
)
SELECT id FROM released
WHERE (SELECT count(*) FROM notified) >= 0
