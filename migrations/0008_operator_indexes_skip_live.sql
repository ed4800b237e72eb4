-- The operator's listing indexes leave live runs out (running, cancel_requested).
--
-- A claim and a completion rewrite the run row outside HOT (they change indexed status), so
-- every index whose predicate holds for the new row version gets an entry: four listing
-- indexes made each claim write four entries that only live as long as the run is live. Live
-- runs are few (one per lease) and list_runs reads them through ix_agent_runs_live instead;
-- pending and finished runs stay in these indexes, in the same keyset order (created_at, id).
--
-- On a populated table: each CREATE INDEX CONCURRENTLY scans agent_runs under a SHARE UPDATE
-- EXCLUSIVE lock (reads, writes and heartbeats go on; other DDL and VACUUM wait), then each
-- DROP INDEX CONCURRENTLY waits for the transactions using the old index. No rewrite. Run
-- outside a transaction; a failed step leaves the old indexes in place and the migration can be
-- run again (an invalid half-built index is dropped first).
-- transactional: false
-- depends: 0007_drop_attempt_identity_index

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_settled_created;
CREATE INDEX CONCURRENTLY ix_agent_runs_settled_created
    ON agent_runs (created_at, id)
    WHERE status NOT IN ('running', 'cancel_requested');

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_settled_agent_created;
CREATE INDEX CONCURRENTLY ix_agent_runs_settled_agent_created
    ON agent_runs (agent_slug, created_at, id)
    WHERE status NOT IN ('running', 'cancel_requested');

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_settled_uid_created;
CREATE INDEX CONCURRENTLY ix_agent_runs_settled_uid_created
    ON agent_runs (uid, created_at, id)
    WHERE status NOT IN ('running', 'cancel_requested');

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_settled_thread_created;
CREATE INDEX CONCURRENTLY ix_agent_runs_settled_thread_created
    ON agent_runs (thread_id, created_at, id)
    WHERE status NOT IN ('running', 'cancel_requested');

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_created;

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_agent_created;

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_uid_created;

DROP INDEX CONCURRENTLY IF EXISTS ix_agent_runs_thread_created;
