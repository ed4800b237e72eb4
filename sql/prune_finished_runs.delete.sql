-- prune_finished_runs.delete: one batch, step 2: delete the trees step 1 locked, except a tree
--          that gained a child step 1 could not see (committed before its locks were taken).
-- from: the runs of step 1 (ids) with their roots, all locked by this transaction
-- to:   those runs deleted, attempts with them (ON DELETE CASCADE); nothing when dry_run
-- returns: one row: runs and attempts deleted (or that would be)
-- notes: a new statement, so a new snapshot: every child committed before step 1's locks is
--        seen here, and a later one waits for this transaction (its foreign key check locks
--        the parent), then finds its parent gone
WITH doomed AS (
    SELECT d.id, d.root FROM unnest(%(ids)s::text[], %(roots)s::text[]) AS d (id, root)
),
-- A child outside its tree would lose its parent: its whole tree waits for a later pass.
cut AS (
    SELECT DISTINCT d.root
    FROM doomed d
    JOIN agent_runs c ON c.created_by_run_id = d.id
    WHERE NOT EXISTS (SELECT FROM doomed x WHERE x.id = c.id)
),
going AS (
    SELECT d.id FROM doomed d WHERE d.root NOT IN (SELECT cut.root FROM cut)
),
gone AS (
    DELETE FROM agent_runs r
    WHERE r.id IN (SELECT going.id FROM going) AND NOT %(dry_run)s::boolean
    RETURNING r.id
)
SELECT (SELECT count(*) FROM going) AS runs,
       (SELECT count(*) FROM agent_run_attempts a WHERE a.run_id IN (SELECT id FROM going))
           AS attempts,
       (SELECT count(*) FROM gone) AS deleted
