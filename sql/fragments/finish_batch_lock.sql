-- finish_batch_lock: a batch of ends as rows (`decided`: run_id, worker_id, status, error_type,
-- error_message, output) and its runs locked in id order (`locked`: id, concurrency_key).
-- slots: owners (the parameter of the owners' worker_ids, one per run)
-- notes: sql/README.md (lock order)

batch AS (
    -- Arrays behind a sub-select: the planner's estimate no longer depends on their length, so
    -- the prepared statement keeps one generic plan instead of planning every call.
    SELECT (SELECT %(run_ids)s::text[]) AS run_ids
),
decided AS (
    SELECT *
    FROM unnest((SELECT run_ids FROM batch), (SELECT {{owners}}::text[]),
                (SELECT %(statuses)s::text[]), (SELECT %(error_types)s::text[]),
                (SELECT %(error_messages)s::text[]), (SELECT %(outputs)s::text[]))
         AS d (run_id, worker_id, status, error_type, error_message, output)
),
locked AS (
    SELECT r.id, r.concurrency_key
    FROM agent_runs r
    -- index lookups, never a walk over live runs
    WHERE r.id = ANY ((SELECT run_ids FROM batch)::text[])
    ORDER BY r.id
    FOR UPDATE
)
