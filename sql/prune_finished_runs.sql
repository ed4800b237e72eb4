-- prune_finished_runs: one batch, step 1: lock whole trees of terminal runs finished before a
--          cutoff (step 2, prune_finished_runs.delete, checks them again and deletes them).
-- from: roots (no parent) in (finished_at, id) order after the keyset, at most batch_size, held
--       by nobody (SKIP LOCKED), whose every descendant is terminal, older and unheld
-- to:   nothing yet: every run of those trees locked FOR UPDATE until the batch commits
-- returns: one row: cutoff (now - older_than_seconds, or the given one), roots examined, the
--          next keyset, and the trees' runs with their roots (two parallel arrays)
WITH RECURSIVE clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
horizon AS (
    SELECT coalesce(%(cutoff)s::timestamptz,
                    clock.now - make_interval(secs => %(older_than_seconds)s::float8)) AS cutoff
    FROM clock
),
roots AS (
    SELECT r.id, r.finished_at
    FROM agent_runs r
    WHERE r.finished_at IS NOT NULL
      AND r.finished_at < (SELECT cutoff FROM horizon)
      AND (r.finished_at, r.id) > (coalesce(%(after_finished_at)s::timestamptz, '-infinity'),
                                   coalesce(%(after_id)s::text, ''))
      AND r.created_by_run_id IS NULL
      AND r.status IN ('completed', 'failed', 'cancelled', 'interrupted')
    ORDER BY r.finished_at, r.id
    LIMIT %(batch_size)s
    FOR UPDATE SKIP LOCKED
),
tree (root, id) AS (
    SELECT roots.id, roots.id FROM roots
    UNION
    SELECT t.root, c.id FROM tree t JOIN agent_runs c ON c.created_by_run_id = t.id
),
-- Descendants that may go: terminal, finished before the cutoff, and not held by anyone.
members AS (
    SELECT r.id
    FROM agent_runs r
    WHERE r.id IN (SELECT t.id FROM tree t WHERE t.id <> t.root)
      AND r.finished_at IS NOT NULL
      AND r.finished_at < (SELECT cutoff FROM horizon)
      AND r.status IN ('completed', 'failed', 'cancelled', 'interrupted')
    FOR UPDATE SKIP LOCKED
),
whole AS (
    SELECT t.root
    FROM tree t
    GROUP BY t.root
    HAVING bool_and(t.id = t.root OR EXISTS (SELECT FROM members m WHERE m.id = t.id))
),
doomed AS (
    SELECT t.root, t.id FROM tree t WHERE t.root IN (SELECT whole.root FROM whole)
),
last_root AS (
    SELECT roots.finished_at, roots.id FROM roots ORDER BY roots.finished_at DESC, roots.id DESC
    LIMIT 1
)
SELECT (SELECT cutoff FROM horizon) AS cutoff,
       (SELECT count(*) FROM roots) AS examined,
       (SELECT finished_at FROM last_root) AS last_finished_at,
       (SELECT id FROM last_root) AS last_id,
       coalesce((SELECT array_agg(doomed.id) FROM doomed), '{}') AS ids,
       coalesce((SELECT array_agg(doomed.root) FROM doomed), '{}') AS roots
