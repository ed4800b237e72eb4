-- get_run_by_owner: the live run (running/cancel_requested) whose lease this owner token holds.
-- A worker whose claim reply was lost (connection cut after COMMIT) finds its run this way
-- instead of leaving it to expire. Read through ix_agent_runs_live: only live runs are scanned.
SELECT *
FROM agent_runs
WHERE worker_id = %(worker_id)s::text AND status IN ('running', 'cancel_requested')
