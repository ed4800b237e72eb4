-- notify_finished: the `notified` CTE of an end: agent_runs_finished for each `finished` run that
-- a waiter registered; the final SELECT reads it, or it never runs.
-- notes: sql/README.md (wake-ups, who waits)

notified AS (
    SELECT pg_notify('agent_runs_finished', finished.id) FROM finished
    WHERE agent_run_waiters_take(finished.id)
)
