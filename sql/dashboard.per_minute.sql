-- dashboard.per_minute: runs finished per minute over the last hour, by final status.
-- from: terminal runs finished since the start of the minute an hour before now
-- to:   nothing (read only)
-- returns: (minute, status, n), oldest minute first; minutes with no run have no row
WITH clock AS (
    SELECT date_trunc('minute', coalesce(%(now)s::timestamptz, now())) - interval '59 minutes'
               AS since
)
SELECT date_trunc('minute', r.finished_at) AS minute, r.status, count(*) AS n
FROM agent_runs r
WHERE r.finished_at IS NOT NULL AND r.finished_at >= (SELECT since FROM clock)
GROUP BY 1, 2
ORDER BY 1, 2
