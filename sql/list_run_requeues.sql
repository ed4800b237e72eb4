-- list_run_requeues: a run's requeues, oldest first.
-- from: any run
-- to:   nothing (read only)
-- returns: its agent_run_requeues rows by requeued_at, id; none for a run never requeued
SELECT * FROM agent_run_requeues WHERE run_id = %(run_id)s ORDER BY requeued_at, id
