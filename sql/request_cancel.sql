-- request_cancel: cancel a run at once if it never started, else ask its owner to.
-- from: pending | running (cancel_requested and terminal runs stay unchanged)
-- to:   pending never started -> cancelled (wakes its waiters); else cancel_requested
--       (an ownerless one wakes agent_runs_claimable: its claimer finishes it cancelled)
-- returns: no row for a missing run, else the run as it is now
-- notes: sql/README.md (clock, data-modifying CTEs, wake-ups)
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
    -- An owned run notifies nothing: its owner sees the request on its next heartbeat. A
    -- cancelled one only if someone waits for it.
    SELECT CASE WHEN changed.never_started
                THEN pg_notify('agent_runs_finished', changed.id)
                ELSE pg_notify('agent_runs_claimable', changed.agent_slug) END
    FROM changed
    WHERE CASE WHEN changed.never_started THEN agent_run_waiters_take(changed.id)
               ELSE changed.worker_id IS NULL END
)
SELECT changed.* FROM changed
WHERE (SELECT count(*) FROM notified) >= 0
UNION ALL
SELECT locked.* FROM locked WHERE NOT EXISTS (SELECT FROM changed)
