-- renew_leases: renew_lease for many (run_id, worker_id) leases in one statement.
-- from: per lease: running | cancel_requested, same worker_id, lease_expires_at > now
-- to:   as renew_lease; runs are locked in id order, so two batches never deadlock
-- returns: (id, status) of each run renewed; a refused lease is absent
-- notes: sql/README.md (clock, CASE not IN, lock order)
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
    SET (heartbeat_at, lease_expires_at, updated_at) =
        (renewed.heartbeat_at, renewed.lease_expires_at, renewed.heartbeat_at)
    FROM renewed
    WHERE a.run_id = ANY (%(run_ids)s::text[]) AND a.run_id = renewed.id
      AND a.finished_at IS NULL AND a.worker_id = renewed.worker_id
    RETURNING a.id
)
SELECT id, status FROM renewed
