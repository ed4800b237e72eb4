-- wait_for_run.register: register a waiter for the run's end, then read the run under a lock.
-- from: any run (a missing or terminal one registers nothing)
-- to:   a row in agent_run_waiters, which makes the run's terminal transition notify
-- returns: the run's id and whether a registration was written; no row for a missing run
-- notes: sql/README.md (wake-ups: who waits); migrations/0011_run_waiters.sql (the race)
WITH registered AS (
    INSERT INTO agent_run_waiters (run_id, waiter_id, expires_at)
    SELECT r.id, %(waiter_id)s::text,
           now() + make_interval(secs => %(expires_in_seconds)s::double precision)
    FROM agent_runs r
    WHERE r.id = %(run_id)s::text
      AND CASE r.status WHEN 'pending' THEN true WHEN 'running' THEN true
                        WHEN 'cancel_requested' THEN true END
    RETURNING run_id
),
-- FOR SHARE waits for a finisher holding the run row (then this reads the run as it ended),
-- or holds the row until the registration commits (then the finisher waits and sees it).
locked AS (
    SELECT r.id, r.status, r.worker_id, r.agent_slug
    FROM agent_runs r
    WHERE r.id = %(run_id)s::text
    FOR SHARE OF r
),
-- A claimer that meets the row locked here skips it (SKIP LOCKED) and sleeps until its next
-- wake-up: a run still claimable once locked is announced again, delivered when the lock goes.
announced AS (
    SELECT pg_notify('agent_runs_claimable', locked.agent_slug)
    FROM locked
    WHERE locked.status = 'pending'
       OR (locked.status = 'cancel_requested' AND locked.worker_id IS NULL)
)
SELECT locked.id, EXISTS (SELECT FROM registered) AS registered
FROM locked
WHERE (SELECT count(*) FROM announced) >= 0
