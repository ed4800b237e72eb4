-- claim_next: the initial claim of mark_running, on the first claimable run.
-- from: pending | ownerless cancel_requested with available_at <= now, by (priority,
--       available_at, id), of agent_slugs if given, whose concurrency_key is below its limit
-- to:   pending -> running, owned, leased; any open attempt -> lease_expired; attempt max + 1
-- returns: the run as it is now and the attempt_no it opened, no row when nothing is claimable
-- notes: sql/README.md (clock, CASE not IN, data-modifying CTEs, lock order)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
candidate AS (
    -- One priority after the other, each read in ix_agent_runs_claimable order up to now: runs
    -- scheduled for later are never read, the backlog is never sorted.
    SELECT c.id, c.concurrency_key
    FROM (VALUES (0), (1), (2), (3), (4), (5), (6), (7), (8), (9)) AS p (priority)
    CROSS JOIN LATERAL (
        SELECT r.id, r.concurrency_key
        FROM agent_runs r
        WHERE r.priority = p.priority
          -- available by the given clock or the database's, whichever is later
          AND r.available_at <= (SELECT greatest(now, now()) FROM clock)
          AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
          AND CASE WHEN %(agent_slugs)s::text[] IS NULL THEN true
                   ELSE r.agent_slug = ANY (%(agent_slugs)s::text[]) END
          -- limits per key: a run of a key at its limit is passed over, keeping its place.
          AND NOT r.key_waiting
          AND (r.concurrency_key IS NULL OR NOT EXISTS (
              SELECT FROM agent_run_limits l
              WHERE l.concurrency_key = r.concurrency_key AND l.running >= l.max_running))
        ORDER BY r.available_at, r.id
        LIMIT 1
        FOR UPDATE SKIP LOCKED
    ) AS c
    LIMIT 1
),
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
expired AS (
    UPDATE agent_run_attempts a
    SET (finished_at, updated_at, outcome, error_type, error_message) =
        (lease.now, lease.now, 'lease_expired', 'worker_lease_expired', %(lost_message)s::text)
    FROM lease
    WHERE a.run_id = (SELECT id FROM candidate) AND a.finished_at IS NULL
    RETURNING a.id
),
opened AS (
    INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, heartbeat_at,
                                    lease_expires_at, created_at, updated_at)
    SELECT lease.id, previous.n + 1, %(worker_id)s::text,
           greatest(lease.now, previous.ended), lease.now, lease.expires_at, lease.now, lease.now
    FROM lease,
         -- The run's own attempts only: the FILTER keeps the planner from reading max() backward
         -- off ix_agent_run_attempts_finished, a walk over every finished attempt.
         LATERAL (SELECT coalesce(max(a.attempt_no), 0) AS n,
                         max(a.finished_at) FILTER (WHERE a.finished_at IS NOT NULL) AS ended
                  FROM agent_run_attempts a WHERE a.run_id = lease.id) AS previous
    WHERE (SELECT count(*) FROM expired) >= 0
    RETURNING attempt_no
)
UPDATE agent_runs r
SET status = CASE WHEN r.status = 'pending' THEN 'running' ELSE r.status END,
    worker_id = %(worker_id)s::text,
    heartbeat_at = lease.now,
    lease_expires_at = lease.expires_at,
    started_at = coalesce(r.started_at, lease.now),
    updated_at = lease.now
FROM lease
WHERE r.id = lease.id
RETURNING r.*, (SELECT attempt_no FROM opened) AS attempt_no
