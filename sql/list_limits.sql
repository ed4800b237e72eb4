-- list_limits: every key with a limit, its counted runs and its waiting runs, by key.
-- from: every agent_run_limits row
-- to:   nothing (read only)
-- returns: (concurrency_key, max_running, running, waiting, oldest_waiting_at), by key
-- notes: sql/README.md (limits); waiting counts the key's pending runs through
--        ix_agent_runs_key_active (an operator's read, never a claim's)
SELECT l.concurrency_key, l.max_running, l.running, w.waiting, w.oldest_waiting_at
FROM agent_run_limits l
CROSS JOIN LATERAL (
    SELECT count(*) AS waiting, min(r.created_at) AS oldest_waiting_at
    FROM agent_runs r
    WHERE r.concurrency_key = l.concurrency_key
      AND r.status IN ('pending', 'running', 'cancel_requested')
      AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
) AS w
ORDER BY l.concurrency_key
