-- Back to 0004's listing indexes over every run (built before the settled ones are dropped).
-- transactional: false

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_created;
CREATE INDEX CONCURRENTLY ix_agent_runs_created
    ON agent_runs (created_at, id);

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_agent_created;
CREATE INDEX CONCURRENTLY ix_agent_runs_agent_created
    ON agent_runs (agent_slug, created_at, id);

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_uid_created;
CREATE INDEX CONCURRENTLY ix_agent_runs_uid_created
    ON agent_runs (uid, created_at, id);

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_thread_created;
CREATE INDEX CONCURRENTLY ix_agent_runs_thread_created
    ON agent_runs (thread_id, created_at, id);

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_settled_thread_created;

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_settled_uid_created;

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_settled_agent_created;

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_settled_created;
