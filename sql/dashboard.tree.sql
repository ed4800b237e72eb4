-- dashboard.tree: a run's sub-agent tree: from its topmost ancestor at most `up` levels above
--                 it (0: the run itself), every descendant at most `down` levels below that top.
-- from: any run; ancestors by created_by_run_id, then descendants breadth first
-- to:   nothing (read only)
-- returns: (id, parent, depth, status, agent_slug, created_at, error_type, more_above,
--          more_below), at most limit rows, parents before children; no row for a missing run.
--          more_above: the top row's parent exists (the view starts below the real root);
--          more_below: a row at depth `down` has children this view leaves out.
WITH RECURSIVE up (id, parent, hops) AS (
    SELECT r.id, r.created_by_run_id, 0 FROM agent_runs r WHERE r.id = %(run_id)s::text
    UNION ALL
    SELECT p.id, p.created_by_run_id, up.hops + 1
    FROM up JOIN agent_runs p ON p.id = up.parent
    WHERE up.hops < %(up)s::int
),
top AS (SELECT id FROM up ORDER BY hops DESC LIMIT 1),
down (id, depth, path) AS (
    SELECT id, 0, ARRAY[id] FROM top
    UNION ALL
    SELECT c.id, down.depth + 1, down.path || c.id
    FROM down JOIN agent_runs c ON c.created_by_run_id = down.id
    WHERE down.depth < %(down)s::int AND NOT c.id = ANY (down.path)
)
SELECT r.id, r.created_by_run_id AS parent, d.depth, r.status, r.agent_slug, r.created_at,
       r.error_type,
       d.depth = 0 AND r.created_by_run_id IS NOT NULL
           AND EXISTS (SELECT 1 FROM agent_runs p WHERE p.id = r.created_by_run_id)
           AS more_above,
       d.depth = %(down)s::int
           AND EXISTS (SELECT 1 FROM agent_runs c WHERE c.created_by_run_id = r.id)
           AS more_below
FROM (SELECT * FROM down ORDER BY path LIMIT %(limit)s) d
JOIN agent_runs r ON r.id = d.id
ORDER BY d.path
