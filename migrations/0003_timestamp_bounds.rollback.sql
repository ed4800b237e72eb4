-- Statements pair with 0003's in reverse order (the trigger first, the runs' CHECK last).
DROP TRIGGER IF EXISTS agent_runs_json_guard ON agent_runs;

DROP FUNCTION IF EXISTS agent_runs_json_guard();

DROP FUNCTION IF EXISTS agent_runs_json_problem(jsonb);

ALTER TABLE agent_run_attempts DROP CONSTRAINT IF EXISTS ck_agent_run_attempts_timestamps_in_range;

ALTER TABLE agent_runs DROP CONSTRAINT IF EXISTS ck_agent_runs_timestamps_in_range;
