-- run_stats.workers: per worker identity (owner token without its last ':' part), attempts
-- from: attempts finished in the window
-- to:   nothing (read only)
-- returns: attempts, completions, failures, lease losses and retries per identity, most
--          troubled (lease losses + failures) first, at most top rows
SELECT regexp_replace(a.worker_id, ':[^:]*$', '') AS worker,
       count(*) AS attempts,
       count(*) FILTER (WHERE a.outcome = 'completed') AS completions,
       count(*) FILTER (WHERE a.outcome = 'failed') AS failures,
       count(*) FILTER (WHERE a.outcome = 'lease_expired') AS lease_losses,
       count(*) FILTER (WHERE a.outcome = 'retry_released') AS retries
FROM agent_run_attempts a
WHERE a.finished_at IS NOT NULL
  AND a.finished_at >= coalesce(%(window_start)s::timestamptz, '-infinity')
GROUP BY 1
ORDER BY count(*) FILTER (WHERE a.outcome IN ('lease_expired', 'failed')) DESC,
         attempts DESC, worker
LIMIT %(top)s
