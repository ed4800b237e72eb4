-- dashboard.children: the runs a run created (its sub-agent runs), oldest first.
-- from: runs whose created_by_run_id is the given run
-- to:   nothing (read only)
-- returns: (id, status, agent_slug, created_at), at most limit rows
SELECT r.id, r.status, r.agent_slug, r.created_at
FROM agent_runs r
WHERE r.created_by_run_id = %(run_id)s::text
ORDER BY r.created_at, r.id
LIMIT %(limit)s
