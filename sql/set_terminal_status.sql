-- set_terminal_status (SPEC 3): lock the run, then finish it when the rule allows:
--   pending -> failed/cancelled, only with no worker_id;
--   running -> completed/failed/interrupted, cancel_requested -> cancelled, only by the owner
--     with a live lease (lease_expires_at > now).
-- On a real transition: status, error fields, finished_at, lease cleared, and the owner's open
-- attempt finishes with outcome = status and the same error classification. Otherwise nothing
-- is written. Returns no row for a missing run, else `changed` and the run as it is now.
-- The guarded UPDATE takes the run row lock (and re-checks its guard on the locked row); only
-- when it refuses is the row read, locked FOR UPDATE, for the unchanged answer.
-- now = coalesce(%(now)s, now()): the given clock, else the transaction's.
-- A real transition notifies agent_runs_finished with the run id, delivered at commit; a
-- refusal notifies nothing. `notified` is read by the final SELECT (a CTE nobody reads is never
-- executed).
-- The rule is a CASE on the status, not `status IN (...)` tests beside the id lookup: the planner
-- would take those for the predicate of the partial indexes over active runs and, after a quiet
-- ANALYZE (those indexes then look empty), walk one of them for a single id.
WITH finished AS (
    UPDATE agent_runs r
    SET status = %(status)s::text,
        error_type = %(error_type)s::text,
        error_message = %(error_message)s::text,
        finished_at = coalesce(%(now)s::timestamptz, now()),
        worker_id = NULL,
        heartbeat_at = NULL,
        lease_expires_at = NULL,
        updated_at = coalesce(%(now)s::timestamptz, now())
    WHERE r.id = %(run_id)s
      AND CASE r.status
          WHEN 'pending' THEN
              %(worker_id)s::text IS NULL AND %(status)s::text IN ('failed', 'cancelled')
          WHEN 'running' THEN
              r.worker_id = %(worker_id)s::text
              AND r.lease_expires_at > coalesce(%(now)s::timestamptz, now())
              AND %(status)s::text <> 'cancelled'
          WHEN 'cancel_requested' THEN
              r.worker_id = %(worker_id)s::text
              AND r.lease_expires_at > coalesce(%(now)s::timestamptz, now())
              AND %(status)s::text = 'cancelled'
          END
    RETURNING r.*
),
attempt AS (
    -- The owner's open attempt: the owner is the worker_id the guard matched (a pending run
    -- is finished only with no worker_id, so it finishes no attempt).
    UPDATE agent_run_attempts a
    SET finished_at = finished.finished_at,
        outcome = %(status)s::text,
        error_type = %(error_type)s::text,
        error_message = %(error_message)s::text,
        updated_at = finished.finished_at
    FROM finished
    WHERE a.run_id = %(run_id)s AND a.finished_at IS NULL
      AND a.worker_id = %(worker_id)s::text
    RETURNING a.id
),
refused AS (
    SELECT r.*
    FROM agent_runs r
    WHERE r.id = %(run_id)s AND NOT EXISTS (SELECT FROM finished)
    FOR UPDATE
),
notified AS (
    SELECT pg_notify('agent_runs_finished', finished.id) FROM finished
)
SELECT true AS changed, finished.* FROM finished
WHERE (SELECT count(*) FROM notified) >= 0
UNION ALL
SELECT false AS changed, refused.* FROM refused
