-- request_cancel (SPEC 3): lock the run, then
--   pending that never started (no started_at) -> cancelled at once (no attempt is invented);
--   any other pending or running run -> cancel_requested (the owner, if any, keeps its lease,
--     sees the request on its next heartbeat and finishes the run as cancelled);
--   cancel_requested or terminal -> unchanged.
-- Returns no row for a missing run, else the run as it is now.
-- Notifications, delivered at commit: a run cancelled at once -> agent_runs_finished (run id);
-- an ownerless cancel_requested (released, then cancelled) is claimable again, its claimer
-- finishing it cancelled -> agent_runs_claimable (agent_slug). An owned run notifies nothing:
-- its owner sees the request on its next heartbeat. `notified` is read by the final SELECT (a
-- CTE nobody reads is never executed).
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
),
notified AS (
    SELECT CASE WHEN changed.never_started
                THEN pg_notify('agent_runs_finished', changed.id)
                ELSE pg_notify('agent_runs_claimable', changed.agent_slug) END
    FROM changed
    WHERE changed.never_started OR changed.worker_id IS NULL
)
SELECT changed.* FROM changed
WHERE (SELECT count(*) FROM notified) >= 0
UNION ALL
SELECT locked.* FROM locked WHERE NOT EXISTS (SELECT FROM changed)
