-- mark_running (SPEC 3, rule "mark_running"): lock the run, then
--   initial claim (pending, or cancel_requested with no owner): pending -> running (an ownerless
--     cancel_requested stays cancel_requested, now owned); converge any attempt still open to
--     lease_expired, then open attempt max + 1 for the new owner;
--   same live owner (running/cancel_requested, same worker_id, lease_expires_at > now): refresh
--     the lease and that owner's open attempt, no new attempt;
--   anything else (missing, terminal, another owner, expired lease): nothing written.
-- Returns no row for a missing run, else one row: `acquired` and the run as it is now.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
locked AS (
    SELECT r.*,
           (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
               AS initial_claim
    FROM agent_runs r
    WHERE r.id = %(run_id)s
    FOR UPDATE
),
claimed AS (
    UPDATE agent_runs r
    SET status = CASE WHEN r.status = 'pending' THEN 'running' ELSE r.status END,
        worker_id = %(worker_id)s::text,
        heartbeat_at = clock.now,
        lease_expires_at = clock.now + make_interval(secs => %(lease_seconds)s::float8),
        started_at = coalesce(r.started_at, clock.now),
        updated_at = clock.now
    FROM locked, clock
    WHERE r.id = locked.id
      AND (locked.initial_claim
           OR (locked.status IN ('running', 'cancel_requested')
               AND locked.worker_id = %(worker_id)s::text
               AND locked.lease_expires_at > clock.now))
    RETURNING r.*, locked.initial_claim
),
expired AS (
    UPDATE agent_run_attempts a
    SET finished_at = clock.now,
        outcome = 'lease_expired',
        error_type = 'worker_lease_expired',
        error_message = %(lost_message)s::text,
        updated_at = clock.now
    FROM claimed, clock
    WHERE claimed.initial_claim
      AND a.run_id = %(run_id)s AND a.run_id = claimed.id AND a.finished_at IS NULL
    RETURNING a.id
),
opened AS (
    INSERT INTO agent_run_attempts (
        run_id, attempt_no, worker_id, started_at, heartbeat_at, lease_expires_at,
        created_at, updated_at
    )
    SELECT claimed.id, previous.attempt_no + 1, claimed.worker_id,
           -- now() is the transaction's start: never let an attempt start before the one
           -- it follows finished (a release may commit between our BEGIN and our lock).
           greatest(clock.now, previous.finished_at),
           claimed.heartbeat_at, claimed.lease_expires_at, clock.now, clock.now
    FROM claimed, clock,
         LATERAL (SELECT coalesce(max(a.attempt_no), 0) AS attempt_no,
                         max(a.finished_at) AS finished_at
                  FROM agent_run_attempts a
                  WHERE a.run_id = claimed.id) AS previous
    -- Reading `expired` first closes the old attempt before the new one opens.
    WHERE claimed.initial_claim AND (SELECT count(*) FROM expired) >= 0
    RETURNING id
),
refreshed AS (
    UPDATE agent_run_attempts a
    SET heartbeat_at = claimed.heartbeat_at,
        lease_expires_at = claimed.lease_expires_at,
        updated_at = claimed.updated_at
    FROM claimed
    WHERE NOT claimed.initial_claim
      AND a.run_id = %(run_id)s AND a.run_id = claimed.id AND a.finished_at IS NULL
      AND a.worker_id = claimed.worker_id
    RETURNING a.id
)
SELECT true AS acquired, claimed.* FROM claimed
UNION ALL
SELECT false AS acquired, locked.* FROM locked WHERE NOT EXISTS (SELECT FROM claimed)
