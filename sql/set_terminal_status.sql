-- set_terminal_status: finish the run when the rule allows.
-- from: pending, no worker_id (failed | cancelled); of the live owner (lease_expires_at > now):
--       running (completed | failed | interrupted), cancel_requested (cancelled)
-- to:   status, errors, output, finished_at = now, no lease; owner's open attempt -> outcome
-- returns: no row for a missing run, else `changed` and the run as it is now
-- notes: sql/README.md (clock, CASE not IN, data-modifying CTEs, wake-ups: agent_runs_finished)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
finished AS (
    -- The guarded UPDATE takes the run row lock and re-checks its guard on the locked row.
    UPDATE agent_runs r
    SET (status, error_type, error_message, output) =
        (%(status)s::text, %(error_type)s::text, %(error_message)s::text, %(output)s::jsonb),
        (worker_id, heartbeat_at, lease_expires_at) = (NULL, NULL, NULL),
        finished_at = clock.now,
        updated_at = clock.now
    FROM clock
    WHERE r.id = %(run_id)s
      AND CASE r.status
          WHEN 'pending' THEN
              %(worker_id)s::text IS NULL AND %(status)s::text IN ('failed', 'cancelled')
          WHEN 'running' THEN
              r.worker_id = %(worker_id)s::text
              AND r.lease_expires_at > clock.now
              AND %(status)s::text <> 'cancelled'
          WHEN 'cancel_requested' THEN
              r.worker_id = %(worker_id)s::text
              AND r.lease_expires_at > clock.now
              AND %(status)s::text = 'cancelled'
          END
    RETURNING r.*
),
-- The owner is the worker_id the guard matched (a pending run finishes no attempt).
-- include: close_attempt,
--   where: a.run_id = %(run_id)s AND a.finished_at IS NULL
--    AND a.worker_id = %(worker_id)s::text
refused AS (
    -- Only when the guard refused: the row, locked, for the unchanged answer.
    SELECT r.*
    FROM agent_runs r
    WHERE r.id = %(run_id)s AND NOT EXISTS (SELECT FROM finished)
    FOR UPDATE
),
-- include: notify_finished
SELECT true AS changed, finished.* FROM finished
WHERE (SELECT count(*) FROM notified) >= 0
UNION ALL
SELECT false AS changed, refused.* FROM refused
