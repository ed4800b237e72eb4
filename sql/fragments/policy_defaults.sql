-- policy_defaults: run_policy's back-off and deadline columns, else the built-in policy's (0 s,
-- 3600 s, 0.2, no deadline: agent_runs.policies.RunPolicy's defaults).
-- notes: sql/README.md (policies)

coalesce(p.backoff_seconds, 0) AS backoff_seconds,
coalesce(p.backoff_max_seconds, 3600) AS backoff_max_seconds,
coalesce(p.backoff_jitter, 0.2) AS backoff_jitter,
p.deadline_seconds
