-- set_limit: create or change a key's concurrency limit (agent_run_limits).
-- from: any key; a new row counts the key's live runs (set_limit.lock is held first)
-- to:   max_running set, updated_at; running counted for a new row, kept for an existing one;
--       wakes agent_runs_claimable when the key has a waiting run
-- returns: the limit row as it is now
-- notes: sql/README.md (clock, limits, wake-ups)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
saved AS (
    INSERT INTO agent_run_limits AS l (concurrency_key, max_running, running, updated_at)
    SELECT %(concurrency_key)s::text, %(max_running)s::int,
           (SELECT count(*) FROM agent_runs r
            WHERE r.concurrency_key = %(concurrency_key)s::text
              AND r.status IN ('pending', 'running', 'cancel_requested')
              AND (r.status = 'running' OR r.worker_id IS NOT NULL)),
           clock.now
    FROM clock
    ON CONFLICT (concurrency_key) DO UPDATE
    SET (max_running, updated_at) = (excluded.max_running, excluded.updated_at)
    RETURNING l.*
),
-- A raised limit admits at the next claim: wake a worker for the key's oldest waiting run.
-- include: oldest_waiting_run,
notified AS (
    SELECT pg_notify('agent_runs_claimable', waiting.agent_slug) FROM waiting, saved
    WHERE saved.running < saved.max_running
)
SELECT saved.* FROM saved
WHERE (SELECT count(*) FROM notified) >= 0
