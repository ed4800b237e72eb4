-- Back to no limits per key: the counter's triggers and functions, agent_run_limits, the
-- key's index, its CHECK and the column go (the keys stored on runs with it).

DROP TRIGGER agent_run_limits_count_delete ON agent_runs;
DROP TRIGGER agent_run_limits_count_update ON agent_runs;
DROP TRIGGER agent_run_limits_count_insert ON agent_runs;
DROP FUNCTION agent_run_limits_count();
DROP FUNCTION agent_run_limits_bump(text, integer);
DROP TABLE agent_run_limits;
DROP INDEX ix_agent_runs_key_active;
ALTER TABLE agent_runs DROP CONSTRAINT ck_agent_runs_concurrency_key;
ALTER TABLE agent_runs DROP COLUMN concurrency_key;
