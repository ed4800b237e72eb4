-- renew_leases: renew_lease for many (run_id, worker_id) leases in one statement.
-- from: per lease: running | cancel_requested, same worker_id, lease_expires_at > now
-- to:   as renew_lease; runs are locked in id order, so two batches never deadlock
-- returns: (id, status) of each run renewed; a refused lease is absent
-- notes: sql/README.md (clock, CASE not IN, data-modifying CTEs, lock order)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
lease AS (
    -- Read as one-row sub-selects (run once per statement), never joined: the lock step and the
    -- updates then carry no copy of the clock per row (less server CPU per lease).
    SELECT now, now + make_interval(secs => %(lease_seconds)s::float8) AS expires_at FROM clock
),
leases AS (
    -- Arrays behind sub-selects: the plan does not depend on their length, so the prepared
    -- statement keeps one generic plan instead of planning every call.
    SELECT *
    FROM unnest((SELECT %(run_ids)s::text[]), (SELECT %(worker_ids)s::text[]))
         AS l (run_id, worker_id)
),
locked AS (
    -- The batch's runs in one index scan over the given ids, not one lookup per lease; the
    -- owner is matched through a hashed IN inside a CASE, as for the attempts below.
    SELECT r.id
    FROM agent_runs r
    WHERE r.id = ANY ((SELECT %(run_ids)s::text[])::text[])
      AND CASE WHEN (r.id, r.worker_id) IN (SELECT run_id, worker_id FROM leases) THEN true END
      AND CASE r.status WHEN 'running' THEN true WHEN 'cancel_requested' THEN true END
      AND r.lease_expires_at > (SELECT now FROM clock)
    -- The sort, not the plan, orders the locks.
    ORDER BY r.id
    FOR UPDATE OF r
),
renewed AS (
    UPDATE agent_runs r
    SET (heartbeat_at, lease_expires_at, updated_at) = (SELECT now, expires_at, now FROM lease)
    -- Already locked (and checked under the lock): found again in one index scan, in any order.
    WHERE r.id = ANY (ARRAY(SELECT id FROM locked))
    RETURNING r.id, r.status, r.worker_id
),
attempts AS (
    -- The owners' open attempts in one index scan over the renewed ids (an array built once),
    -- never a walk over every open attempt. The owner is matched through a hashed IN, kept
    -- inside a CASE so that it stays one: as a join, the planner may walk the one-open index
    -- when it looks empty, or repeat the array scan once per run.
    UPDATE agent_run_attempts a
    SET (heartbeat_at, lease_expires_at, updated_at) = (SELECT now, expires_at, now FROM lease)
    WHERE a.run_id = ANY (ARRAY(SELECT id FROM renewed))
      AND a.finished_at IS NULL
      AND CASE WHEN (a.run_id, a.worker_id) IN (SELECT id, worker_id FROM renewed) THEN true END
)
SELECT id, status FROM renewed
