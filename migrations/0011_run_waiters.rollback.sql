-- Back to 0008: no waiter registrations (the SQL of the release before 0011 notifies
-- agent_runs_finished for every run).

DROP FUNCTION agent_run_waiters_take(text);

DROP TABLE agent_run_waiters;
