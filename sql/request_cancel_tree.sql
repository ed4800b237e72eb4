-- request_cancel_tree: lock the run and every run created by it, recursively (step 1 of 2).
-- from: the run and its descendants by created_by_run_id, terminal ones included
-- to:   nothing yet: request_cancel then runs on each pending or running one, same transaction
-- returns: id, status and created_at of each, locked in id order; no row for a missing run
-- notes: sql/README.md (lock order); run again until it finds no new run (a child committed
--        after this statement's snapshot but before its locks shows up in the next one)
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
