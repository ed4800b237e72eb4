-- request_cancel_tree, step 1: the run and every run created by it, recursively (by
-- created_by_run_id, through terminal runs too), each row locked, in id order so that two
-- tree cancels never wait on each other in a cycle. Returns each run's status under its lock;
-- no row when the run does not exist. Step 2 applies request_cancel to each run that a cancel
-- request changes (pending or running), in the same transaction.
WITH RECURSIVE tree (id) AS (
    SELECT r.id FROM agent_runs r WHERE r.id = %(run_id)s::text
    UNION
    SELECT c.id FROM agent_runs c JOIN tree t ON c.created_by_run_id = t.id
)
SELECT r.id, r.status, r.created_at
FROM agent_runs r
WHERE r.id IN (SELECT id FROM tree)
ORDER BY r.id
FOR UPDATE
