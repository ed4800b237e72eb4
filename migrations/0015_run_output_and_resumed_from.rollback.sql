-- Back to 0012: no run output, no resume point on attempts (both are dropped with their data).
-- transactional: false

DROP TRIGGER IF EXISTS agent_run_attempts_resume_guard ON agent_run_attempts;

DROP FUNCTION IF EXISTS agent_run_attempts_resume_guard();

ALTER TABLE agent_run_attempts DROP CONSTRAINT IF EXISTS ck_agent_run_attempts_resumed_from;

ALTER TABLE agent_run_attempts DROP COLUMN IF EXISTS resumed_from, DROP COLUMN IF EXISTS resumed_step;

ALTER TABLE agent_runs DROP COLUMN IF EXISTS output;
