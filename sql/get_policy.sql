-- get_policy: the effective recovery policy of an agent slug.
-- from: the slug's agent_run_policies row, else the '*' row, else none
-- to:   nothing (read only)
-- returns: one row: the row found (source = its agent_slug), or NULL columns (built-in)
SELECT p.agent_slug AS source, p.max_attempts, p.max_lost_leases, p.backoff_seconds,
       p.backoff_max_seconds, p.backoff_jitter, p.deadline_seconds, p.updated_at
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
    SELECT * FROM agent_run_policies p
    WHERE p.agent_slug = %(agent_slug)s::text OR p.agent_slug = '*'
    ORDER BY p.agent_slug = '*'
    LIMIT 1
) AS p ON true
