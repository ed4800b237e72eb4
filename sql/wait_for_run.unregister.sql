-- wait_for_run.unregister: remove this waiter's registration and a batch of expired ones.
-- from: this waiter's row (gone already when the run's end took it); rows past expires_at
-- to:   deleted; rows another session holds are skipped (never waits, never deadlocks)
-- returns: nothing
-- notes: migrations/0011_run_waiters.sql (expired rows are left by killed waiters)
DELETE FROM agent_run_waiters w
WHERE (w.run_id = %(run_id)s::text AND w.waiter_id = %(waiter_id)s::text)
   OR w.ctid = ANY (ARRAY(
        SELECT x.ctid FROM agent_run_waiters x
        WHERE x.expires_at < now()
        ORDER BY x.expires_at
        LIMIT 100
        FOR UPDATE SKIP LOCKED))
