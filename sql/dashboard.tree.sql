-- dashboard.tree: the run's whole sub-agent tree: its root ancestor and every descendant.
-- from: any run; ancestors by created_by_run_id (at most 100 up), then descendants breadth first
-- to:   nothing (read only)
-- returns: (id, parent, depth, status, agent_slug, created_at), at most limit rows, parents
--          before children; no row for a missing run
WITH RECURSIVE up (id, parent, hops) AS (
    SELECT r.id, r.created_by_run_id, 0 FROM agent_runs r WHERE r.id = %(run_id)s::text
    UNION ALL
    SELECT p.id, p.created_by_run_id, up.hops + 1
    FROM up JOIN agent_runs p ON p.id = up.parent
    WHERE up.hops < 100
),
root AS (SELECT id FROM up ORDER BY hops DESC LIMIT 1),
down (id, depth, path) AS (
    SELECT id, 0, ARRAY[id] FROM root
    UNION ALL
    SELECT c.id, down.depth + 1, down.path || c.id
    FROM down JOIN agent_runs c ON c.created_by_run_id = down.id
    WHERE down.depth < 100 AND NOT c.id = ANY (down.path)
)
SELECT r.id, r.created_by_run_id AS parent, d.depth, r.status, r.agent_slug, r.created_at
FROM (SELECT * FROM down ORDER BY path LIMIT %(limit)s) d
JOIN agent_runs r ON r.id = d.id
ORDER BY d.path
