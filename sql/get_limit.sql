-- get_limit: one key's limit, its counted runs and its waiting runs.
-- from: the key's agent_run_limits row, if any
-- to:   nothing (read only)
-- returns: (concurrency_key, max_running, running, waiting), no row when the key has no limit
SELECT l.concurrency_key, l.max_running, l.running,
       (SELECT count(*) FROM agent_runs r
        WHERE r.concurrency_key = l.concurrency_key
          AND r.status IN ('pending', 'running', 'cancel_requested')
          AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL)))
           AS waiting
FROM agent_run_limits l
WHERE l.concurrency_key = %(concurrency_key)s::text
