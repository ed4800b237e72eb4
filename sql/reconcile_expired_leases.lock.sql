-- reconcile_expired_leases.lock: lock, oldest lease first, the runs that lost their owner.
-- from: running | cancel_requested whose owner's lease expired (lease_expires_at <= now);
--       cancel_requested with no owner that had started (released, then cancelled)
-- to:   nothing yet: the rows stay locked for reconcile_expired_leases, in this transaction
-- returns: the ids locked, at most limit, skipping rows others hold (SKIP LOCKED)
-- notes: sql/README.md (clock, lock order)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
)
SELECT r.id
FROM agent_runs r, clock
WHERE r.status IN ('running', 'cancel_requested')  -- through ix_agent_runs_live
  AND ((r.worker_id IS NOT NULL AND r.lease_expires_at <= clock.now)
       OR (r.status = 'cancel_requested' AND r.worker_id IS NULL AND r.started_at IS NOT NULL))
ORDER BY r.lease_expires_at NULLS FIRST, r.id
LIMIT %(limit)s
FOR UPDATE OF r SKIP LOCKED
