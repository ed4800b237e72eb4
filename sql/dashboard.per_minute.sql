-- dashboard.per_minute: runs finished per minute over the last hour, by final status.
-- from: terminal runs finished since the start of the minute an hour before now
-- to:   nothing (read only)
-- returns: (minute, status, n), oldest minute first; minutes with no run have no row
-- The bound is written in place (not read from a CTE) so the planner can estimate it and
-- range-scan ix_agent_runs_finished.
SELECT date_trunc('minute', r.finished_at) AS minute, r.status, count(*) AS n
FROM agent_runs r
WHERE r.finished_at IS NOT NULL
  AND r.finished_at >= date_trunc('minute', coalesce(%(now)s::timestamptz, now()))
                       - interval '59 minutes'
GROUP BY 1, 2
ORDER BY 1, 2
