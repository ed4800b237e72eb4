-- reconcile_expired_leases: converge the runs reconcile_expired_leases.lock locked.
-- from: those run ids, still running | cancel_requested
-- to:   failed / worker_lease_expired (at-least-once message), lease cleared; every open
--       attempt -> lease_expired; wakes agent_runs_finished for each run someone waits for
-- returns: the converged runs as they are now, by id
-- notes: sql/README.md (clock, CASE not IN, data-modifying CTEs, lock order, wake-ups)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
-- limits per key: the runs' limit rows, in key order, before the counter's trigger updates them
-- at the statement's end (the runs are locked already: reconcile_expired_leases.lock).
key_slots AS (
    SELECT l.concurrency_key FROM agent_run_limits l
    WHERE l.concurrency_key IN (SELECT k.concurrency_key FROM agent_runs k
                                WHERE k.id = ANY (%(run_ids)s::text[]))
    ORDER BY l.concurrency_key
    FOR UPDATE
),
converged AS (
    UPDATE agent_runs r
    SET (status, error_type, error_message) =
        ('failed', 'worker_lease_expired', %(lost_message)s::text),
        (worker_id, heartbeat_at, lease_expires_at) = (NULL, NULL, NULL),
        finished_at = clock.now,
        updated_at = clock.now
    FROM clock
    WHERE r.id = ANY (%(run_ids)s::text[])
      AND CASE r.status WHEN 'running' THEN true WHEN 'cancel_requested' THEN true END
    RETURNING r.*
),
attempts AS (
    UPDATE agent_run_attempts a
    SET (finished_at, updated_at, outcome, error_type, error_message) =
        (converged.finished_at, converged.finished_at, 'lease_expired', converged.error_type,
         converged.error_message)
    FROM converged
    WHERE a.run_id = ANY (%(run_ids)s::text[]) AND a.run_id = converged.id
      AND a.finished_at IS NULL
    RETURNING a.id
),
notified AS (
    SELECT pg_notify('agent_runs_finished', converged.id) FROM converged
    WHERE agent_run_waiters_take(converged.id)
)
SELECT converged.* FROM converged
WHERE (SELECT count(*) FROM notified) >= 0
  AND (SELECT count(*) FROM key_slots) >= 0  -- limits per key
ORDER BY converged.id
