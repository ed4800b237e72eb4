-- dashboard.per_minute: runs finished per minute over the last hour, by final status.
-- from: terminal runs finished since the start of the minute an hour before now
-- to:   nothing (read only)
-- returns: (minute, status, n), oldest minute first; minutes with no run have no row
-- The bound reads clock as an InitPlan parameter, which the index condition on
-- ix_agent_runs_finished takes (sql/README.md, Clock).
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
)
SELECT date_trunc('minute', r.finished_at) AS minute, r.status, count(*) AS n
FROM agent_runs r
WHERE r.finished_at IS NOT NULL
  AND r.finished_at >= date_trunc('minute', (SELECT now FROM clock))
                       - interval '59 minutes'
GROUP BY 1, 2
ORDER BY 1, 2
