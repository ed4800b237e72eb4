-- reconcile_expired_leases, step 1 of 2 (SPEC 3): find and lock, oldest lease first, the runs
-- that lost their owner: running with an expired lease; cancel_requested whose owner's lease
-- expired; cancel_requested with no owner that had started (released, then cancelled).
-- SKIP LOCKED: concurrent reconcilers (and live owners mid-transition) are never waited for,
-- and no run is processed twice. Live runs are found through ix_agent_runs_live.
SELECT r.id
FROM agent_runs r
WHERE r.status IN ('running', 'cancel_requested')
  AND ((r.worker_id IS NOT NULL AND r.lease_expires_at <= coalesce(%(now)s::timestamptz, now()))
       OR (r.status = 'cancel_requested' AND r.worker_id IS NULL AND r.started_at IS NOT NULL))
ORDER BY r.lease_expires_at NULLS FIRST, r.id
LIMIT %(limit)s
FOR UPDATE SKIP LOCKED
