-- Drop the operator's indexes (in reverse order of creation).
-- transactional: false

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_run_attempts_finished;

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_run_attempts_identity;

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_finished;

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_thread_created;

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_uid_created;

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_agent_created;

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_status_created;

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_created;
