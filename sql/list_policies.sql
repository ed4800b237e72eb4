-- list_policies: every configured recovery policy, by agent slug ('*' first).
-- from: agent_run_policies
-- to:   nothing (read only)
-- returns: its rows
SELECT p.agent_slug AS source, p.* FROM agent_run_policies p ORDER BY p.agent_slug
