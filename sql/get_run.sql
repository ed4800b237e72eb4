-- get_run: the current state of one run.
SELECT * FROM agent_runs WHERE id = %(run_id)s
