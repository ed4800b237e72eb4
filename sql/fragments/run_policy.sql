-- run_policy: the policy of a run, as `p`: its slug's agent_run_policies row, else the '*' row,
-- else none (NULL columns: the statement's built-in defaults, policy_defaults).
-- slots: run (the alias whose agent_slug it reads)
-- notes: sql/README.md (policies)

LEFT JOIN LATERAL (
    SELECT * FROM agent_run_policies p
    WHERE p.agent_slug = {{run}}.agent_slug OR p.agent_slug = '*'
    ORDER BY p.agent_slug = '*'
    LIMIT 1
) AS p ON true
