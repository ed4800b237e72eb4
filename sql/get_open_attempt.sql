-- get_open_attempt: the attempt of the current owner, if any (at most one, by a unique index).
SELECT * FROM agent_run_attempts WHERE run_id = %(run_id)s AND finished_at IS NULL
