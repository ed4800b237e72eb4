-- telemetry_queue: live runs by status and agent slug, and each group's oldest creation.
-- from: pending | running | cancel_requested runs (the gauges of agent_runs.telemetry)
-- to:   nothing (read only)
-- returns: (status, agent_slug, runs, oldest_seconds) per group, no row when nothing is live
-- notes: sql/README.md (clock)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
)
SELECT r.status, r.agent_slug, count(*) AS runs,
       extract(epoch FROM clock.now - min(r.created_at))::float8 AS oldest_seconds
FROM agent_runs r, clock
WHERE r.status IN ('pending', 'running', 'cancel_requested')
GROUP BY r.status, r.agent_slug, clock.now
