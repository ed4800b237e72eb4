-- finish_runs: set_terminal_status for many runs of their live owners, in one statement.
-- from: per run: running (completed | failed | interrupted), cancel_requested (cancelled),
--       of the given worker_id with a live lease (lease_expires_at > now)
-- to:   as set_terminal_status; runs are locked in id order, so two batches never deadlock
-- returns: (id, finished_at) of each run finished; a refused or missing run is absent
-- notes: sql/README.md (clock, CASE not IN, data-modifying CTEs, lock order, wake-ups)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
-- include: finish_batch_lock,
--   owners: %(worker_ids)s
-- limits per key: the batch's limit rows, locked after the runs and in key order, before the
-- counter's trigger updates them at the statement's end (sql/README.md, limits).
key_slots AS (
    SELECT l.concurrency_key FROM agent_run_limits l
    WHERE l.concurrency_key IN (SELECT locked.concurrency_key FROM locked)
    ORDER BY l.concurrency_key
    FOR UPDATE
),
-- include: finish_batch_runs
SELECT finished.id, finished.finished_at FROM finished
WHERE (SELECT count(*) FROM notified) >= 0
  AND (SELECT count(*) FROM key_slots) >= 0  -- limits per key
