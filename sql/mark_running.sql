-- mark_running: claim the run by id (initial claim), or refresh it for its live owner.
-- from: pending | ownerless cancel_requested; or running | cancel_requested of this live owner
-- to:   pending -> running, leased; initial claim: open attempt -> lease_expired, attempt max + 1
--       opens; same owner: its open attempt's lease refreshed; anything else: nothing written
-- returns: no row for a missing run, else `acquired` and the run as it is now
-- notes: sql/README.md (clock, data-modifying CTEs, lock order)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
locked AS (
    SELECT r.*,
           (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
               AS initial_claim
    FROM agent_runs r
    WHERE r.id = %(run_id)s
    FOR UPDATE
),
-- limits per key: the run's limit row, locked after the run (sql/README.md, limits).
key_slots AS (
    SELECT l.max_running - l.running AS free
    FROM agent_run_limits l
    WHERE l.concurrency_key = (SELECT concurrency_key FROM locked WHERE initial_claim)
    FOR UPDATE
),
claimed AS (
    UPDATE agent_runs r
    SET status = CASE WHEN r.status = 'pending' THEN 'running' ELSE r.status END,
        worker_id = %(worker_id)s::text,
        heartbeat_at = clock.now,
        lease_expires_at = clock.now + make_interval(secs => %(lease_seconds)s::float8),
        started_at = coalesce(r.started_at, clock.now),
        updated_at = clock.now
    FROM locked, clock
    WHERE r.id = locked.id
      AND (locked.initial_claim
           OR (locked.status IN ('running', 'cancel_requested')
               AND locked.worker_id = %(worker_id)s::text
               AND locked.lease_expires_at > clock.now))
      -- limits per key: an initial claim only while the run's key has a free slot.
      AND (NOT locked.initial_claim OR coalesce((SELECT free FROM key_slots), 1) > 0)
    RETURNING r.*, locked.initial_claim
),
-- include: expire_attempts,
--   at: claimed.updated_at
--   from: claimed
--   where: a.run_id = %(run_id)s AND a.run_id = claimed.id AND a.finished_at IS NULL
--    AND claimed.initial_claim
-- include: open_attempt,
--   run: c
--   values: c.worker_id, greatest(c.updated_at, previous.ended),
--         c.heartbeat_at, c.lease_expires_at, c.updated_at, c.updated_at
--   from: claimed c
--   when: c.initial_claim AND
--   returning: id
refreshed AS (
    UPDATE agent_run_attempts a
    SET (heartbeat_at, lease_expires_at, updated_at) =
        (claimed.heartbeat_at, claimed.lease_expires_at, claimed.updated_at)
    FROM claimed
    WHERE a.run_id = %(run_id)s AND a.run_id = claimed.id AND a.finished_at IS NULL
      AND a.worker_id = claimed.worker_id AND NOT claimed.initial_claim
    RETURNING a.id
)
SELECT true AS acquired, claimed.* FROM claimed
UNION ALL
SELECT false AS acquired, locked.* FROM locked WHERE NOT EXISTS (SELECT FROM claimed)
