-- get_run: the current state of one run.
-- from: any run
-- to:   nothing (read only)
-- returns: the run, no row when it does not exist
SELECT * FROM agent_runs WHERE id = %(run_id)s
