-- dashboard.agents: per agent, runs finished in the window by outcome and the top error type.
-- from: terminal runs finished since window_start
-- to:   nothing (read only)
-- returns: one row per agent slug, the most failing first, at most top rows
SELECT r.agent_slug AS agent,
       count(*) AS finished,
       count(*) FILTER (WHERE r.status = 'completed') AS completed,
       count(*) FILTER (WHERE r.status = 'failed') AS failed,
       count(*) FILTER (WHERE r.status = 'interrupted') AS interrupted,
       count(*) FILTER (WHERE r.status = 'cancelled') AS cancelled,
       mode() WITHIN GROUP (ORDER BY r.error_type) AS top_error_type
FROM agent_runs r
WHERE r.finished_at IS NOT NULL AND r.finished_at >= %(window_start)s::timestamptz
GROUP BY r.agent_slug
ORDER BY failed DESC, finished DESC, agent
LIMIT %(top)s
