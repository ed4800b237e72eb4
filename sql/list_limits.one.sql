-- list_limits.one: how many runs of one key wait (pending), for set_limit's answer.
-- from: the key's active runs, through ix_agent_runs_key_active
-- to:   nothing (read only)
-- returns: one row (waiting)
SELECT count(*) AS waiting
FROM agent_runs r
WHERE r.concurrency_key = %(concurrency_key)s::text
  AND r.status IN ('pending', 'running', 'cancel_requested')
  AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
