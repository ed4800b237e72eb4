-- create_run: a new run starts `pending`, with no lease and no attempt.
-- Idempotent on request_id: a repeated request inserts nothing (the caller then reads the
-- existing run in a new statement, whose snapshot sees a concurrent creator's commit).
-- A real insert wakes the workers: NOTIFY agent_runs_claimable with the run's agent_slug, in
-- this transaction, so it is delivered at commit (never before the run is visible) and a
-- rolled-back create wakes nobody. A repeated request notifies nothing. `notified` is read
-- by the final SELECT: a CTE nobody reads is never executed.
WITH created AS (
    INSERT INTO agent_runs (
        id, request_id, thread_id, agent_slug, uid, run_type, created_by_run_id, input_payload
    )
    VALUES (
        %(run_id)s, %(request_id)s, %(thread_id)s, %(agent_slug)s, %(uid)s, %(run_type)s,
        %(created_by_run_id)s, %(input_payload)s
    )
    ON CONFLICT (request_id) DO NOTHING
    RETURNING *
),
notified AS (
    SELECT pg_notify('agent_runs_claimable', created.agent_slug) FROM created
)
SELECT created.* FROM created
WHERE (SELECT count(*) FROM notified) >= 0
