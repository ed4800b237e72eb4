-- run_stats.runs: terminal runs finished in the window, by final status.
-- from: completed | failed | cancelled | interrupted runs
-- to:   nothing (read only)
-- returns: (key, n), most frequent first
SELECT r.status AS key, count(*) AS n
FROM agent_runs r
WHERE r.finished_at IS NOT NULL
  AND r.finished_at >= coalesce(%(window_start)s::timestamptz, '-infinity')
  AND r.status IN ('completed', 'failed', 'cancelled', 'interrupted')
GROUP BY r.status
ORDER BY n DESC, key
