-- get_open_attempt: the attempt of the run's current owner.
-- from: any run
-- to:   nothing (read only)
-- returns: the open attempt (at most one, by a unique index), no row when none is open
SELECT * FROM agent_run_attempts WHERE run_id = %(run_id)s AND finished_at IS NULL
