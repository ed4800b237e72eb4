-- finish_runs: set_terminal_status for many runs of their live owners, in one statement.
-- from: per run: running (completed | failed | interrupted), cancel_requested (cancelled),
--       of the given worker_id with a live lease (lease_expires_at > now)
-- to:   as set_terminal_status; runs are locked in id order, so two batches never deadlock
-- returns: (id, finished_at) of each run finished; a refused or missing run is absent
-- notes: sql/README.md (clock, CASE not IN, data-modifying CTEs, lock order, wake-ups)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
batch AS (
    -- Arrays behind a sub-select: the planner's estimate no longer depends on their length, so
    -- the prepared statement keeps one generic plan instead of planning every call.
    SELECT (SELECT %(run_ids)s::text[]) AS run_ids
),
decided AS (
    SELECT *
    FROM unnest((SELECT run_ids FROM batch), (SELECT %(worker_ids)s::text[]),
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
),
-- limits per key: the batch's limit rows, locked after the runs and in key order, before the
-- counter's trigger updates them at the statement's end (sql/README.md, limits).
key_slots AS (
    SELECT l.concurrency_key FROM agent_run_limits l
    WHERE l.concurrency_key IN (SELECT locked.concurrency_key FROM locked)
    ORDER BY l.concurrency_key
    FOR UPDATE
),
finished AS (
    UPDATE agent_runs r
    SET (status, error_type, error_message, output) =
        (d.status, d.error_type, d.error_message, d.output::jsonb),
        (worker_id, heartbeat_at, lease_expires_at) = (NULL, NULL, NULL),
        finished_at = clock.now,
        updated_at = clock.now
    FROM locked, decided d, clock
    WHERE r.id = locked.id AND d.run_id = r.id
      AND r.worker_id = d.worker_id
      AND r.lease_expires_at > clock.now
      AND CASE r.status
          WHEN 'running' THEN d.status IN ('completed', 'failed', 'interrupted')
          WHEN 'cancel_requested' THEN d.status = 'cancelled'
          END
    RETURNING r.id, r.status, r.error_type, r.error_message, r.finished_at, d.worker_id
),
attempt AS (
    -- Each run's owner is the worker_id its guard matched.
    UPDATE agent_run_attempts a
    SET (finished_at, updated_at, outcome, error_type, error_message) =
        (finished.finished_at, finished.finished_at, finished.status, finished.error_type,
         finished.error_message)
    FROM finished
    WHERE a.run_id = ANY ((SELECT run_ids FROM batch)::text[]) AND a.run_id = finished.id
      AND a.finished_at IS NULL
      AND a.worker_id = finished.worker_id
    RETURNING a.id
),
notified AS (
    SELECT pg_notify('agent_runs_finished', finished.id) FROM finished
    WHERE agent_run_waiters_take(finished.id)
)
SELECT finished.id, finished.finished_at FROM finished
WHERE (SELECT count(*) FROM notified) >= 0
  AND (SELECT count(*) FROM key_slots) >= 0  -- limits per key
