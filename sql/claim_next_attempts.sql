-- claim_next_attempts: claim_next for up to one run per worker_id, in one statement.
-- from: as claim_next; the first claimable runs not locked by another claimer, at most one each
-- to:   as claim_next for each run; the n-th run in claim order goes to the n-th worker_id
-- returns: each run claimed as it is now, with the attempt_no it opened; no row when none
-- notes: sql/README.md (clock, CASE not IN, data-modifying CTEs, lock order)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
-- include: claim_candidates,
--   columns: c.id, c.priority, c.available_at, c.concurrency_key
--   run_columns: r.id, r.priority, r.available_at, r.concurrency_key
--   limit: cardinality(%(worker_ids)s::text[])
-- include: claim_admission,
-- include: lease_attempts
-- include: lease_runs
--   owner: lease.worker_id
--   from: lease, opened
--   where: r.id = lease.id AND opened.run_id = lease.id
--   attempt_no: opened.attempt_no
