-- claim_next (SPEC 3): the initial claim of mark_running, applied to the oldest claimable run
-- (pending, or cancel_requested with no owner) by (created_at, id), optionally of the given
-- agent slugs, skipping rows another claimer has locked. Read in ix_agent_runs_claimable order:
-- no sort of the backlog. pending -> running; ownerless cancel_requested -> owned
-- cancel_requested. Any attempt left open is converged to lease_expired, then attempt max + 1
-- opens. Returns no row when nothing is claimable, else the run as it is now.
-- now = coalesce(%(now)s, now()): the given clock, else the transaction's.
-- The run's UPDATE is the statement itself (its RETURNING is the answer); the attempts are
-- written beside it from the locked candidate, whose update cannot fail: we hold its lock.
WITH candidate AS (
    SELECT r.id
    FROM agent_runs r
    WHERE (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
      -- A CASE, not an OR: the generic plan's estimate then matches the custom one's, so the
      -- prepared statement keeps its generic plan instead of being re-planned on every call.
      AND CASE WHEN %(agent_slugs)s::text[] IS NULL THEN true
               ELSE r.agent_slug = ANY (%(agent_slugs)s::text[]) END
    ORDER BY r.created_at, r.id
    LIMIT 1
    FOR UPDATE SKIP LOCKED
),
lease AS (
    SELECT candidate.id,
           coalesce(%(now)s::timestamptz, now()) AS now,
           coalesce(%(now)s::timestamptz, now())
               + make_interval(secs => %(lease_seconds)s::float8) AS expires_at
    FROM candidate
),
expired AS (
    UPDATE agent_run_attempts a
    SET finished_at = lease.now,
        outcome = 'lease_expired',
        error_type = 'worker_lease_expired',
        error_message = %(lost_message)s::text,
        updated_at = lease.now
    FROM lease
    -- The candidate's id as a scalar: an index lookup of the run's open attempt, never a walk
    -- over every open attempt (the planner thinks a 1-row CTE makes either one cheap).
    WHERE a.run_id = (SELECT id FROM candidate) AND a.finished_at IS NULL
    RETURNING a.id
),
opened AS (
    INSERT INTO agent_run_attempts (
        run_id, attempt_no, worker_id, started_at, heartbeat_at, lease_expires_at,
        created_at, updated_at
    )
    SELECT lease.id, previous.attempt_no + 1, %(worker_id)s::text,
           -- now() is the transaction's start: never let an attempt start before the one
           -- it follows finished (a release may commit between our BEGIN and our lock).
           greatest(lease.now, previous.finished_at),
           lease.now, lease.expires_at, lease.now, lease.now
    FROM lease,
         LATERAL (SELECT coalesce(max(a.attempt_no), 0) AS attempt_no,
                         max(a.finished_at) AS finished_at
                  FROM agent_run_attempts a
                  WHERE a.run_id = lease.id) AS previous
    -- Reading `expired` first closes the old attempt before the new one opens.
    WHERE (SELECT count(*) FROM expired) >= 0
    RETURNING id
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
RETURNING r.*
