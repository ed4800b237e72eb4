-- dashboard.live: live runs by status (with how many hold an expired lease, and how many are
--                 scheduled for later), the oldest available one of each status, and whether
--                 the server is a hot standby.
-- from: pending, running and cancel_requested runs
-- to:   nothing (read only)
-- returns: (key, n, expired, scheduled, oldest, in_recovery): one row per non-terminal status,
--          plus one row 'in_recovery' that always exists
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
)
SELECT r.status AS key, count(*) AS n,
       count(*) FILTER (WHERE r.lease_expires_at <= clock.now)
           AS expired,
       count(*) FILTER (WHERE r.available_at > clock.now) AS scheduled,
       min(r.created_at) FILTER (WHERE r.available_at <= clock.now) AS oldest,
       NULL::boolean AS in_recovery
FROM agent_runs r, clock
WHERE r.status IN ('pending', 'running', 'cancel_requested')
GROUP BY r.status, clock.now
UNION ALL
SELECT 'in_recovery', 0, 0, 0, NULL, pg_is_in_recovery()
