-- telemetry_queue: live runs by status and agent slug, and each group's oldest creation.
-- from: pending | running | cancel_requested runs (the gauges of agent_runs.telemetry)
-- to:   nothing (read only)
-- returns: (status, agent_slug, runs, oldest_seconds) per group, no row when nothing is live
-- notes: sql/README.md (clock)
SELECT r.status, r.agent_slug, count(*) AS runs,
       extract(epoch FROM coalesce(%(now)s::timestamptz, now()) - min(r.created_at))::float8
           AS oldest_seconds
FROM agent_runs r
WHERE r.status IN ('pending', 'running', 'cancel_requested')
GROUP BY r.status, r.agent_slug
