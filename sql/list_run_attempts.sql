-- list_run_attempts: the execution history of one run.
-- from: any run
-- to:   nothing (read only)
-- returns: its attempts, oldest first (by attempt_no)
SELECT * FROM agent_run_attempts WHERE run_id = %(run_id)s ORDER BY attempt_no
