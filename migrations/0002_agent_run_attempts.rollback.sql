DROP TABLE agent_run_attempts;
DROP FUNCTION agent_run_attempts_guard();
