-- Indexes for the operator's queries (listing runs, statistics, retention).
-- None of them covers a column a lease renewal changes (heartbeat_at, lease_expires_at,
-- updated_at), so renewals stay HOT updates. Built CONCURRENTLY: a large table keeps taking
-- writes (and heartbeats) while they build, so this migration runs outside a transaction.
-- transactional: false
-- depends: 0002_agent_run_attempts

-- Newest-first listing, unfiltered or by --since: keyset order (created_at, id).
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_agent_runs_created
    ON agent_runs (created_at, id);

-- Listing by status, agent, user or thread, each in keyset order. By status: terminal runs
-- here; pending ones through ix_agent_runs_claimable, live ones through ix_agent_runs_live
-- (so claims and the reconciler keep their indexes, and only a run's last transition writes
-- to this one).
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_agent_runs_status_created
    ON agent_runs (status, created_at, id)
    WHERE status IN ('completed', 'failed', 'cancelled', 'interrupted');

CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_agent_runs_agent_created
    ON agent_runs (agent_slug, created_at, id);

CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_agent_runs_uid_created
    ON agent_runs (uid, created_at, id);

CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_agent_runs_thread_created
    ON agent_runs (thread_id, created_at, id);

-- Statistics over a window of finished runs, and retention in finishing order.
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_agent_runs_finished
    ON agent_runs (finished_at, id)
    WHERE finished_at IS NOT NULL;

-- Runs by worker identity: the owner token without its last ':' part (worker_id of an
-- attempt never changes).
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_agent_run_attempts_identity
    ON agent_run_attempts (regexp_replace(worker_id, ':[^:]*$', ''), run_id);

-- Statistics over a window of finished attempts (finished_at is written once, at the end).
CREATE INDEX CONCURRENTLY IF NOT EXISTS ix_agent_run_attempts_finished
    ON agent_run_attempts (finished_at)
    WHERE finished_at IS NOT NULL;
