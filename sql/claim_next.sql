-- claim_next: the initial claim of mark_running, on the first claimable run.
-- from: pending | ownerless cancel_requested with available_at <= now, by (priority,
--       available_at, id), of agent_slugs if given, whose concurrency_key is below its limit
-- to:   pending -> running, owned, leased; any open attempt -> lease_expired; attempt max + 1
-- returns: the run as it is now and the attempt_no it opened, no row when nothing is claimable
-- notes: sql/README.md (clock, CASE not IN, data-modifying CTEs, lock order)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
-- include: claim_candidates,
--   columns: c.id, c.concurrency_key
--   run_columns: r.id, r.concurrency_key
--   limit: 1
-- limits per key: the candidate's limit row, locked after the run (sql/README.md, limits).
key_slots AS (
    SELECT l.max_running - l.running AS free
    FROM agent_run_limits l
    WHERE l.concurrency_key = (SELECT concurrency_key FROM candidate)
    FOR UPDATE
),
lease AS (
    SELECT candidate.id, clock.now,
           clock.now + make_interval(secs => %(lease_seconds)s::float8) AS expires_at
    FROM candidate, clock
    WHERE coalesce((SELECT free FROM key_slots), 1) > 0  -- limits per key
),
-- include: expire_attempts,
--   at: lease.now
--   from: lease
--   where: a.run_id = (SELECT id FROM candidate) AND a.finished_at IS NULL
-- include: open_attempt
--   run: lease
--   values: %(worker_id)s::text,
--         greatest(lease.now, previous.ended), lease.now, lease.expires_at, lease.now, lease.now
--   from: lease
--   returning: attempt_no
-- include: lease_runs
--   owner: %(worker_id)s::text
--   from: lease
--   where: r.id = lease.id
--   attempt_no: (SELECT attempt_no FROM opened) AS attempt_no
