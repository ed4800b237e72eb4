-- run_stats: the window's start, attempt durations and the queue right now.
-- from: attempts finished in the window (since_at, else now - since_seconds, else all history:
--       window_start NULL); pending, running and expired-but-unreconciled runs now
-- to:   nothing (read only)
-- returns: one row: window, duration percentiles and maximum, queue counts
-- notes: sql/README.md (clock)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
period AS (
    SELECT coalesce(%(since_at)s::timestamptz,
                    clock.now - make_interval(secs => %(since_seconds)s::float8),
                    '-infinity') AS since
    FROM clock
),
durations AS (
    SELECT extract(epoch FROM a.finished_at - a.started_at)::float8 AS seconds
    FROM agent_run_attempts a
    WHERE a.finished_at IS NOT NULL AND a.finished_at >= (SELECT since FROM period)
),
-- One pass over the pending runs for both figures: a min() alone would be read off
-- ix_agent_runs_settled_created in created_at order, a walk past every older finished run.
pending AS (
    SELECT count(*) AS n, min(r.created_at) AS oldest
    FROM agent_runs r
    WHERE r.status = 'pending'
)
SELECT (SELECT nullif(since, '-infinity') FROM period) AS window_start,
       (SELECT now FROM clock) AS now,
       (SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY seconds) FROM durations)
           AS duration_p50,
       (SELECT percentile_cont(0.95) WITHIN GROUP (ORDER BY seconds) FROM durations)
           AS duration_p95,
       (SELECT max(seconds) FROM durations) AS duration_max,
       (SELECT n FROM pending) AS pending,
       (SELECT oldest FROM pending) AS oldest_pending_created_at,
       (SELECT count(*) FROM agent_runs r WHERE r.status = 'running') AS running,
       (SELECT count(*) FROM agent_runs r
        WHERE r.status IN ('running', 'cancel_requested')
          AND ((r.worker_id IS NOT NULL AND r.lease_expires_at <= (SELECT now FROM clock))
               OR (r.status = 'cancel_requested' AND r.worker_id IS NULL
                   AND r.started_at IS NOT NULL))) AS expired_unreconciled
