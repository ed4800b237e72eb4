-- Rebuild 0004's index of attempts by worker identity (an invalid leftover is dropped first).
-- transactional: false

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_run_attempts_identity;

CREATE INDEX CONCURRENTLY ix_agent_run_attempts_identity
    ON agent_run_attempts (regexp_replace(worker_id, ':[^:]*$', ''), run_id);
