-- run_stats, per worker identity (the owner token without its last ':' part), over attempts
-- that finished in the window: attempts, completions, failures, lease losses (lease_expired)
-- and retries (retry_released). The most troubled first (lease losses + failures), at most
-- %(top)s identities.
SELECT regexp_replace(a.worker_id, ':[^:]*$', '') AS worker,
       count(*) AS attempts,
       count(*) FILTER (WHERE a.outcome = 'completed') AS completions,
       count(*) FILTER (WHERE a.outcome = 'failed') AS failures,
       count(*) FILTER (WHERE a.outcome = 'lease_expired') AS lease_losses,
       count(*) FILTER (WHERE a.outcome = 'retry_released') AS retries
FROM agent_run_attempts a
WHERE a.finished_at IS NOT NULL
  AND a.finished_at >= coalesce(%(since_at)s::timestamptz,
                                coalesce(%(now)s::timestamptz, now())
                                    - make_interval(secs => %(since_seconds)s::float8),
                                '-infinity')
GROUP BY 1
ORDER BY count(*) FILTER (WHERE a.outcome IN ('lease_expired', 'failed')) DESC,
         attempts DESC, worker
LIMIT %(top)s
