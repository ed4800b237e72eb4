-- delete_limit: remove a key's concurrency limit; its runs are unlimited from the next claim.
-- from: the key's agent_run_limits row, if any
-- to:   the row deleted; wakes agent_runs_claimable when the key has a waiting run
-- returns: one row per row deleted (none when the key had no limit)
-- notes: sql/README.md (limits, wake-ups)
WITH deleted AS (
    DELETE FROM agent_run_limits l
    WHERE l.concurrency_key = %(concurrency_key)s::text
    RETURNING l.concurrency_key
),
-- include: oldest_waiting_run,
notified AS (
    SELECT pg_notify('agent_runs_claimable', waiting.agent_slug) FROM waiting, deleted
)
SELECT deleted.concurrency_key FROM deleted
WHERE (SELECT count(*) FROM notified) >= 0
