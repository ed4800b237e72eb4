-- renew_lease: extend the live lease of its owner (run and open attempt).
-- from: running | cancel_requested, same worker_id, lease_expires_at > now
-- to:   same status, heartbeat_at = now, lease_expires_at = now + lease (no indexed column
--       changes, so both updates can be HOT)
-- returns: the run's status when renewed (a cancel request is seen), no row when refused
-- notes: sql/README.md (clock, CASE not IN)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
renewed AS (
    UPDATE agent_runs r
    SET heartbeat_at = clock.now,
        lease_expires_at = clock.now + make_interval(secs => %(lease_seconds)s::float8),
        updated_at = clock.now
    FROM clock
    WHERE r.id = %(run_id)s
      AND r.worker_id = %(worker_id)s::text
      AND CASE r.status WHEN 'running' THEN true WHEN 'cancel_requested' THEN true END
      AND r.lease_expires_at > clock.now
    RETURNING r.status, r.heartbeat_at, r.lease_expires_at
),
attempt AS (
    UPDATE agent_run_attempts a
    SET (heartbeat_at, lease_expires_at, updated_at) =
        (renewed.heartbeat_at, renewed.lease_expires_at, renewed.heartbeat_at)
    FROM renewed
    WHERE a.run_id = %(run_id)s AND a.finished_at IS NULL AND a.worker_id = %(worker_id)s::text
    RETURNING a.id
)
SELECT status FROM renewed
