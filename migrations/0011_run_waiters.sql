-- agent_runs_finished only for a run someone waits for: waiters register in agent_run_waiters.
--
-- A terminal transition used to NOTIFY agent_runs_finished for every run, and PostgreSQL
-- serializes the commits of notifying transactions (one global lock on the notification queue):
-- under load every completion queued behind the others, though almost no run has a waiter.
-- Now wait_for_run (and `agent-runs wait`) registers the run here first, and the terminal
-- statements call agent_run_waiters_take(run id) for each run they end: it deletes the run's
-- registrations and answers whether there were any; only then is the NOTIFY sent.
--
-- No lost wake-up when a registration and the finish race (READ COMMITTED):
-- - the registration inserts its row and reads the run with FOR SHARE in one statement, so it
--   either waits for a finisher that holds the run row (and then reads the run as it ended), or
--   holds the row until its insert commits, and the finisher waits for it;
-- - agent_run_waiters_take is VOLATILE: its DELETE takes a snapshot of its own, after the
--   finisher locked the run row, so it sees a registration committed while the finisher
--   waited for that lock (the finisher's statement snapshot, taken before, would not).
--
-- UNLOGGED: a registration lives as long as its waiter's connection; after a crash there is no
-- waiter left to wake (the table comes back empty), and writing it costs no WAL. A killed
-- waiter's row goes when its run ends (taken by the finisher) or, for a run that never ends,
-- once expires_at passed (deleted by the next waiter that unregisters, a bounded batch).
--
-- On a populated database: a new empty table and a function, no lock on agent_runs.
-- depends: 0010_trace_context

CREATE UNLOGGED TABLE agent_run_waiters (
    run_id text NOT NULL,
    waiter_id text NOT NULL,
    expires_at timestamptz NOT NULL,
    CONSTRAINT agent_run_waiters_pkey PRIMARY KEY (run_id, waiter_id)
);

CREATE INDEX ix_agent_run_waiters_expires ON agent_run_waiters (expires_at);

CREATE FUNCTION agent_run_waiters_take(p_run_id text) RETURNS boolean
LANGUAGE plpgsql VOLATILE PARALLEL UNSAFE AS $$
BEGIN
    DELETE FROM agent_run_waiters WHERE run_id = p_run_id;
    RETURN FOUND;
END
$$;
