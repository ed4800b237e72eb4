-- set_terminal_status (SPEC 3): lock the run, then finish it when the rule allows:
--   pending -> failed/cancelled, only with no worker_id;
--   running -> completed/failed/interrupted, cancel_requested -> cancelled, only by the owner
--     with a live lease (lease_expires_at > now).
-- On a real transition: status, error fields, finished_at, lease cleared, and the owner's open
-- attempt finishes with outcome = status and the same error classification. Otherwise nothing
-- is written. Returns no row for a missing run, else `changed` and the run as it is now.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
locked AS (
    SELECT r.*, r.worker_id AS owner
    FROM agent_runs r
    WHERE r.id = %(run_id)s
    FOR UPDATE
),
finished AS (
    UPDATE agent_runs r
    SET status = %(status)s::text,
        error_type = %(error_type)s::text,
        error_message = %(error_message)s::text,
        finished_at = clock.now,
        worker_id = NULL,
        heartbeat_at = NULL,
        lease_expires_at = NULL,
        updated_at = clock.now
    FROM locked, clock
    WHERE r.id = locked.id
      AND (
          (locked.status = 'pending'
           AND %(worker_id)s::text IS NULL
           AND %(status)s::text IN ('failed', 'cancelled'))
          OR
          (locked.status IN ('running', 'cancel_requested')
           AND locked.worker_id = %(worker_id)s::text
           AND locked.lease_expires_at > clock.now
           AND (locked.status = 'cancel_requested') = (%(status)s::text = 'cancelled'))
      )
    RETURNING r.*, locked.owner
),
attempt AS (
    UPDATE agent_run_attempts a
    SET finished_at = clock.now,
        outcome = %(status)s::text,
        error_type = %(error_type)s::text,
        error_message = %(error_message)s::text,
        updated_at = clock.now
    FROM finished, clock
    WHERE a.run_id = %(run_id)s AND a.run_id = finished.id AND a.finished_at IS NULL
      AND a.worker_id = finished.owner
    RETURNING a.id
)
SELECT true AS changed, finished.* FROM finished
UNION ALL
SELECT false AS changed, locked.* FROM locked WHERE NOT EXISTS (SELECT FROM finished)
