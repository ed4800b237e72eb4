-- create_runs: insert many new runs in one statement, each idempotent on its request_id.
-- from: per item, no run with its request_id (else nothing is inserted for it)
-- to:   pending runs, no lease, no attempt, available_at now unless given; one
--       agent_runs_claimable per agent_slug created
-- returns: each new run (is_new), then each run whose request_id existed before this statement
-- notes: sql/README.md (data-modifying CTEs, wake-ups); a request_id committed by a concurrent
--        creator after this statement's snapshot is in neither part: create_runs.existing
WITH batch AS (
    -- Arrays behind a sub-select: one generic plan whatever the batch's length.
    SELECT (SELECT %(request_ids)s::text[]) AS request_ids
),
items AS (
    SELECT i.*, p.input_payload, nullif(c.trace_context, 'null') AS trace_context
    FROM unnest((SELECT %(run_ids)s::text[]), (SELECT request_ids FROM batch),
                (SELECT %(thread_ids)s::text[]), (SELECT %(agent_slugs)s::text[]),
                (SELECT %(uids)s::text[]), (SELECT %(run_types)s::text[]),
                (SELECT %(created_by_run_ids)s::text[]), (SELECT %(priorities)s::smallint[]),
                (SELECT %(available_ats)s::timestamptz[]),
                (SELECT %(concurrency_keys)s::text[]))
         WITH ORDINALITY
         AS i (id, request_id, thread_id, agent_slug, uid, run_type, created_by_run_id,
               priority, available_at, concurrency_key, ord)
    JOIN jsonb_array_elements((SELECT %(input_payloads)s::jsonb)) WITH ORDINALITY
         AS p (input_payload, ord) ON p.ord = i.ord
    -- Each item's trace context: no array without telemetry, a JSON null without a valid span.
    LEFT JOIN jsonb_array_elements((SELECT %(trace_contexts)s::jsonb)) WITH ORDINALITY
         AS c (trace_context, ord) ON c.ord = i.ord
),
created AS (
    -- The parent of a run may be a run of the same batch: the foreign key is checked at the
    -- end of the statement, when every row of it is in.
    INSERT INTO agent_runs (
        id, request_id, thread_id, agent_slug, uid, run_type, created_by_run_id, input_payload,
        trace_context, priority, available_at, concurrency_key
    )
    SELECT id, request_id, thread_id, agent_slug, uid, run_type, created_by_run_id, input_payload,
           trace_context, priority, coalesce(available_at, now()), concurrency_key
    FROM items
    -- In request_id order: two batches sharing requests wait for each other's uncommitted
    -- request_ids in one order, never in a cycle.
    ORDER BY request_id
    ON CONFLICT (request_id) DO NOTHING
    RETURNING *
),
notified AS (
    SELECT pg_notify('agent_runs_claimable', slugs.agent_slug)
    FROM (SELECT DISTINCT created.agent_slug FROM created) AS slugs
)
SELECT created.*, true AS is_new FROM created
WHERE (SELECT count(*) FROM notified) >= 0
UNION ALL
-- The statement's snapshot never shows its own inserts: these are runs created before it.
-- One index lookup per request_id (LIMIT 1 keeps the lateral a nested loop): a generic plan
-- made while the table was small must not become a scan of it.
SELECT r.*, false
FROM unnest((SELECT request_ids FROM batch)) AS q (request_id)
CROSS JOIN LATERAL (
    SELECT * FROM agent_runs r WHERE r.request_id = q.request_id LIMIT 1
) AS r
