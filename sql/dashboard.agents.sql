-- dashboard.agents: runs finished in the window by final status, in all and per agent, with
--                   each group's most frequent error type.
-- from: terminal runs finished since window_start
-- to:   nothing (read only)
-- returns: first the row of all agents (agent NULL), then one row per agent slug, the most
--          failing first, at most top agents; one pass over the window for both
SELECT r.agent_slug AS agent,
       count(*) AS finished,
       count(*) FILTER (WHERE r.status = 'completed') AS completed,
       count(*) FILTER (WHERE r.status = 'failed') AS failed,
       count(*) FILTER (WHERE r.status = 'interrupted') AS interrupted,
       count(*) FILTER (WHERE r.status = 'cancelled') AS cancelled,
       mode() WITHIN GROUP (ORDER BY r.error_type) AS top_error_type
FROM agent_runs r
WHERE r.finished_at IS NOT NULL AND r.finished_at >= %(window_start)s::timestamptz
GROUP BY GROUPING SETS ((r.agent_slug), ())
ORDER BY GROUPING(r.agent_slug) DESC, failed DESC, finished DESC, agent
LIMIT %(top)s + 1
