-- dashboard.per_minute: runs finished per minute over the last hour, by final status.
-- from: terminal runs finished since the start of the minute an hour before now
-- to:   nothing (read only)
-- returns: (minute, status, n), oldest minute first; minutes with no run have no row
-- The clock is joined, not read through a scalar subquery: PostgreSQL pulls the one-row CTE up,
-- so the bound is an expression the planner estimates and range-scans ix_agent_runs_finished
-- with (plan-tested; as an InitPlan it chose a sequential scan).
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
since AS (
    SELECT date_trunc('minute', now) - interval '59 minutes' AS start FROM clock
)
SELECT date_trunc('minute', r.finished_at) AS minute, r.status, count(*) AS n
FROM agent_runs r, since
WHERE r.finished_at IS NOT NULL
  AND r.finished_at >= since.start
GROUP BY 1, 2
ORDER BY 1, 2
