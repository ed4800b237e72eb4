-- request_cancel (SPEC 3): lock the run, then
--   pending that never started (no started_at) -> cancelled at once (no attempt is invented);
--   any other pending or running run -> cancel_requested (the owner, if any, keeps its lease,
--     sees the request on its next heartbeat and finishes the run as cancelled);
--   cancel_requested or terminal -> unchanged.
-- Returns no row for a missing run, else the run as it is now.
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
locked AS (
    SELECT r.*, (r.status = 'pending' AND r.started_at IS NULL) AS never_started
    FROM agent_runs r
    WHERE r.id = %(run_id)s
    FOR UPDATE
),
changed AS (
    UPDATE agent_runs r
    SET status = CASE WHEN locked.never_started THEN 'cancelled' ELSE 'cancel_requested' END,
        finished_at = CASE WHEN locked.never_started THEN clock.now ELSE r.finished_at END,
        updated_at = clock.now
    FROM locked, clock
    WHERE r.id = locked.id AND locked.status IN ('pending', 'running')
    RETURNING r.*, locked.never_started
)
SELECT changed.* FROM changed
UNION ALL
SELECT locked.* FROM locked WHERE NOT EXISTS (SELECT FROM changed)
