-- get_run_by_owner: the live run whose lease this owner token holds (a lost claim reply).
-- from: running | cancel_requested with this worker_id (read through ix_agent_runs_live)
-- to:   nothing (read only)
-- returns: that run, no row when the token holds none
SELECT *
FROM agent_runs
WHERE worker_id = %(worker_id)s::text AND status IN ('running', 'cancel_requested')
