-- create_run: insert a new run, idempotent on request_id.
-- from: no run with this request_id (else nothing is inserted: see create_run.existing)
-- to:   pending, no lease, no attempt, trace_context (NULL without telemetry), priority,
--       available_at (now unless given); wakes
--       agent_runs_claimable with its agent_slug
-- returns: the new run, no row when the request_id exists already
-- notes: sql/README.md (data-modifying CTEs, wake-ups)
WITH created AS (
    INSERT INTO agent_runs (
        id, request_id, thread_id, agent_slug, uid, run_type, created_by_run_id, input_payload,
        trace_context, priority, available_at, concurrency_key
    )
    VALUES (
        %(run_id)s, %(request_id)s, %(thread_id)s, %(agent_slug)s, %(uid)s, %(run_type)s,
        %(created_by_run_id)s, %(input_payload)s, %(trace_context)s::jsonb,
        %(priority)s::smallint,
        -- not delayed: its creation time (now(), as created_at): FIFO stays as it was
        coalesce(%(available_at)s::timestamptz, now()),
        %(concurrency_key)s::text
    )
    ON CONFLICT (request_id) DO NOTHING
    RETURNING *
),
notified AS (
    SELECT pg_notify('agent_runs_claimable', created.agent_slug) FROM created
)
SELECT created.* FROM created
WHERE (SELECT count(*) FROM notified) >= 0
