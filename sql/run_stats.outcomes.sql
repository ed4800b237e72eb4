-- run_stats.outcomes: attempts finished in the window, by outcome.
-- from: finished attempts
-- to:   nothing (read only)
-- returns: (key, n), most frequent first
SELECT a.outcome AS key, count(*) AS n
FROM agent_run_attempts a
WHERE a.finished_at IS NOT NULL
  AND a.finished_at >= coalesce(%(window_start)s::timestamptz, '-infinity')
GROUP BY a.outcome
ORDER BY n DESC, key
