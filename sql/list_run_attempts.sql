-- list_run_attempts: the execution history of one run, oldest attempt first.
SELECT * FROM agent_run_attempts WHERE run_id = %(run_id)s ORDER BY attempt_no
