-- notify_retried_or_finished: the `notified` CTE of a run its policy decided on:
-- agent_runs_claimable for a retried (pending) run, agent_runs_finished for a failed one that a
-- waiter registered.
-- slots: run (the CTE of the changed runs)
-- notes: sql/README.md (wake-ups, who waits)

notified AS (
    SELECT CASE {{run}}.status
               WHEN 'pending' THEN pg_notify('agent_runs_claimable', {{run}}.agent_slug)
               ELSE pg_notify('agent_runs_finished', {{run}}.id) END
    FROM {{run}}
    WHERE {{run}}.status = 'pending' OR agent_run_waiters_take({{run}}.id)
)
