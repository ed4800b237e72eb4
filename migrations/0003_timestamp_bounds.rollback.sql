-- Statements pair with 0003's in reverse order: this one undoes the attempts' CHECK.
ALTER TABLE agent_run_attempts DROP CONSTRAINT IF EXISTS ck_agent_run_attempts_timestamps_in_range;

ALTER TABLE agent_runs DROP CONSTRAINT IF EXISTS ck_agent_runs_timestamps_in_range;
