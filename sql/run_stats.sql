-- run_stats: the window's start, attempt durations (seconds) of attempts finished in the
-- window, and the queue right now: pending runs and the oldest one's creation, running runs,
-- and live leases that expired and are not reconciled yet (the reconciler's rule).
-- The window starts at since_at, else now - since_seconds, else at the beginning of time
-- (window_start NULL).
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now,
           coalesce(%(since_at)s::timestamptz,
                    coalesce(%(now)s::timestamptz, now())
                        - make_interval(secs => %(since_seconds)s::float8),
                    '-infinity') AS since
),
durations AS (
    SELECT extract(epoch FROM a.finished_at - a.started_at)::float8 AS seconds
    FROM agent_run_attempts a
    WHERE a.finished_at IS NOT NULL AND a.finished_at >= (SELECT since FROM clock)
)
SELECT (SELECT nullif(since, '-infinity') FROM clock) AS window_start,
       (SELECT now FROM clock) AS now,
       (SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY seconds) FROM durations)
           AS duration_p50,
       (SELECT percentile_cont(0.95) WITHIN GROUP (ORDER BY seconds) FROM durations)
           AS duration_p95,
       (SELECT max(seconds) FROM durations) AS duration_max,
       (SELECT count(*) FROM agent_runs r WHERE r.status = 'pending') AS pending,
       (SELECT min(r.created_at) FROM agent_runs r WHERE r.status = 'pending')
           AS oldest_pending_created_at,
       (SELECT count(*) FROM agent_runs r WHERE r.status = 'running') AS running,
       (SELECT count(*) FROM agent_runs r
        WHERE r.status IN ('running', 'cancel_requested')
          AND ((r.worker_id IS NOT NULL AND r.lease_expires_at <= (SELECT now FROM clock))
               OR (r.status = 'cancel_requested' AND r.worker_id IS NULL
                   AND r.started_at IS NOT NULL))) AS expired_unreconciled
