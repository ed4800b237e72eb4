-- dashboard.workers: each worker identity (owner token without its last ':' part) seen in the
--                    window: leases held now, last heartbeat, attempts by outcome, top error
-- from: attempts finished since window_start, and the live runs' leases now
-- to:   nothing (read only)
-- returns: one row per identity, the most troubled (lease losses + failures) first, at most top
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
finished AS (
    SELECT regexp_replace(a.worker_id, ':[^:]*$', '') AS worker,
           count(*) AS attempts,
           count(*) FILTER (WHERE a.outcome = 'completed') AS completed,
           count(*) FILTER (WHERE a.outcome = 'failed') AS failed,
           count(*) FILTER (WHERE a.outcome = 'lease_expired') AS lease_expired,
           count(*) FILTER (WHERE a.outcome = 'retry_released') AS retry_released,
           count(*) FILTER (WHERE a.outcome IN ('cancelled', 'interrupted')) AS stopped,
           max(a.heartbeat_at) AS last_heartbeat,
           mode() WITHIN GROUP (ORDER BY a.error_type) AS top_error_type
    FROM agent_run_attempts a
    WHERE a.finished_at IS NOT NULL AND a.finished_at >= %(window_start)s::timestamptz
    GROUP BY 1
),
live AS (
    SELECT regexp_replace(r.worker_id, ':[^:]*$', '') AS worker,
           count(*) AS leases,
           count(*) FILTER (WHERE r.lease_expires_at <= (SELECT now FROM clock)) AS expired,
           max(r.heartbeat_at) AS last_heartbeat
    FROM agent_runs r
    WHERE r.status IN ('running', 'cancel_requested') AND r.worker_id IS NOT NULL
    GROUP BY 1
)
SELECT coalesce(f.worker, l.worker) AS worker,
       coalesce(l.leases, 0) AS leases,
       coalesce(l.expired, 0) AS expired,
       greatest(f.last_heartbeat, l.last_heartbeat) AS last_heartbeat,
       coalesce(f.attempts, 0) AS attempts,
       coalesce(f.completed, 0) AS completed,
       coalesce(f.failed, 0) AS failed,
       coalesce(f.lease_expired, 0) AS lease_expired,
       coalesce(f.retry_released, 0) AS retry_released,
       coalesce(f.stopped, 0) AS stopped,
       f.top_error_type
FROM finished f
FULL JOIN live l ON l.worker = f.worker
ORDER BY coalesce(f.lease_expired, 0) + coalesce(f.failed, 0) + coalesce(l.expired, 0) DESC,
         coalesce(l.leases, 0) DESC, coalesce(f.attempts, 0) DESC, 1
LIMIT %(top)s
