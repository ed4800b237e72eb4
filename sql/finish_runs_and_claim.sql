-- finish_runs_and_claim: finish_runs, then claim_next_attempts for the slots it freed, in one statement.
-- from: as finish_runs for the batch's runs; as claim_next_attempts for the claimable backlog
-- to:   as finish_runs; then up to one claim per worker_id, less one per refused end
-- returns: one row per run claimed (as claim_next_attempts), or one row of NULL run columns when
--          none was; every row carries the batch's finished run ids and finished_at times
-- notes: sql/README.md (clock, CASE not IN, data-modifying CTEs, lock order, wake-ups, fragments)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
-- finish_runs' ends first. Its finishes' owners are finish_worker_ids: worker_ids are the claim's.
-- include: finish_batch_lock,
--   owners: %(finish_worker_ids)s
-- include: finish_batch_runs,
-- claim_next_attempts' claim from here on, one run per worker_id (a slot whose run ended here, or
-- one already free) but none for a refused end: its slot waits until it is written alone. The
-- finished runs were running: never candidates, so the two halves touch different rows.
-- include: claim_candidates,
--   columns: c.id, c.priority, c.available_at, c.concurrency_key
--   run_columns: r.id, r.priority, r.available_at, r.concurrency_key
--   limit: greatest(0, cardinality(%(worker_ids)s::text[])
--                         + (SELECT count(*) FROM finished)
--                         - cardinality((SELECT run_ids FROM batch)))
--   unless:
--              -- unless this statement's own ends free a slot of it
--              AND l.running - (SELECT count(*) FROM locked
--                               WHERE locked.concurrency_key = l.concurrency_key)
--                  >= l.max_running
-- The limits of the claim and of the batch's own keys, locked together: a slot that this
-- statement's own ends free may be taken by its claims.
-- include: claim_admission,
--   freed:
--         + (SELECT count(*) FROM finished JOIN locked USING (id)
--            WHERE locked.concurrency_key = l.concurrency_key)
--   also_keys:
--                              UNION SELECT locked.concurrency_key FROM locked
-- include: lease_attempts,
claimed AS (
    -- An array of the claimed ids: index lookups, never a walk over the runs (as a CTE, this
    -- join is otherwise planned as a hash join over every run).
    -- include: lease_runs
    --   owner: lease.worker_id
    --   from: lease, opened
    --   where: r.id = ANY (ARRAY(SELECT id FROM lease))
    --    AND r.id = lease.id AND opened.run_id = lease.id
    --   attempt_no: opened.attempt_no
),
ends AS (
    SELECT coalesce(array_agg(id ORDER BY id), '{}') AS finished_ids,
           coalesce(array_agg(finished_at ORDER BY id), '{}') AS finished_ats
    FROM finished
    WHERE (SELECT count(*) FROM notified) >= 0
      AND (SELECT count(*) FROM key_slots) >= 0  -- limits per key: the batch's keys locked
)
SELECT claimed.*, ends.finished_ids, ends.finished_ats
FROM ends LEFT JOIN claimed ON true
