-- run_stats.errors: the most frequent error types of attempts finished in the window.
-- from: finished attempts with an error_type
-- to:   nothing (read only)
-- returns: (key, n), most frequent first, at most top rows
SELECT a.error_type AS key, count(*) AS n
FROM agent_run_attempts a
WHERE a.finished_at IS NOT NULL
  AND a.finished_at >= coalesce(%(window_start)s::timestamptz, '-infinity')
  AND a.error_type IS NOT NULL
GROUP BY a.error_type
ORDER BY n DESC, key
LIMIT %(top)s
