-- requeue_run: an operator runs an ended run again, with a fresh budget.
-- from: failed | cancelled | interrupted
-- to:   pending, available_at = now, error fields, output, finished_at and lease cleared, parked
--       when its key is full; one agent_run_requeues row records it; wakes agent_runs_claimable
-- returns: the run as it is now with changed; the locked run unchanged when its status
--          refuses (completed or not ended); no row for an unknown run
-- notes: sql/README.md (clock, CASE not IN, data-modifying CTEs, wake-ups)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
locked AS (
    SELECT r.id, r.status, r.error_type
    FROM agent_runs r
    WHERE r.id = %(run_id)s
    FOR UPDATE
),
requeued AS (
    UPDATE agent_runs r
    SET status = 'pending',
        (error_type, error_message, finished_at, output) = (NULL, NULL, NULL, NULL),
        (worker_id, heartbeat_at, lease_expires_at) = (NULL, NULL, NULL),
        available_at = clock.now,
        updated_at = clock.now,
        -- limits per key: parked when its key is full (out of the claim index, as a new run
        -- is); the regate trigger then brings it back if an end freed a slot meanwhile
        key_waiting = r.concurrency_key IS NOT NULL AND EXISTS (
            SELECT FROM agent_run_limits l
            WHERE l.concurrency_key = r.concurrency_key AND l.running >= l.max_running)
    FROM locked, clock
    WHERE r.id = locked.id
      AND CASE locked.status
          WHEN 'failed' THEN true WHEN 'cancelled' THEN true WHEN 'interrupted' THEN true END
    RETURNING r.*
),
recorded AS (
    INSERT INTO agent_run_requeues (run_id, requeued_at, previous_status, previous_error_type,
                                    reason)
    SELECT requeued.id, requeued.updated_at, locked.status, locked.error_type, %(reason)s::text
    FROM requeued, locked
    RETURNING id
),
notified AS (
    SELECT pg_notify('agent_runs_claimable', requeued.agent_slug) FROM requeued
)
SELECT true AS changed, requeued.* FROM requeued
WHERE (SELECT count(*) FROM notified) >= 0 AND (SELECT count(*) FROM recorded) >= 0
UNION ALL
SELECT false AS changed, r.* FROM agent_runs r
WHERE r.id = %(run_id)s AND NOT EXISTS (SELECT FROM requeued)
