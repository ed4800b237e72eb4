-- Drop ix_agent_run_attempts_identity: list_runs' worker filter probes each run's attempts by
-- run_id (uq_agent_run_attempts_run_attempt_no: a run has one to a few attempts), so this
-- index only cost two entries per attempt (at its claim and at its close, never a HOT update).
--
-- On a populated table: DROP INDEX CONCURRENTLY takes a SHARE UPDATE EXCLUSIVE lock on
-- agent_run_attempts and waits for the transactions using the index; reads and writes go on.
-- transactional: false
-- depends: 0006_json_guard_after_update

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_run_attempts_identity;
