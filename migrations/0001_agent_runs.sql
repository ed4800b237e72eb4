-- agent_runs: the current aggregate state of each run, for business queries.
-- Every invariant of a row's shape is a named CHECK, so PostgreSQL itself refuses a bad state.

CREATE TABLE agent_runs (
    id                   text        PRIMARY KEY,
    request_id           text        NOT NULL,
    thread_id            text        NOT NULL,
    agent_slug           text        NOT NULL,
    uid                  text        NOT NULL,
    run_type             text        NOT NULL DEFAULT 'chat',
    created_by_run_id    text        NULL REFERENCES agent_runs (id) ON DELETE SET NULL,
    status               text        NOT NULL DEFAULT 'pending',
    input_payload        jsonb       NOT NULL DEFAULT '{}'::jsonb,
    error_type           text,
    error_message        text,
    worker_id            text,
    heartbeat_at         timestamptz,
    lease_expires_at     timestamptz,
    manifest             jsonb,
    manifest_fingerprint text,
    manifest_recorded_at timestamptz,
    started_at           timestamptz,
    finished_at          timestamptz,
    created_at           timestamptz NOT NULL DEFAULT now(),
    updated_at           timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT uq_agent_runs_request_id UNIQUE (request_id),
    CONSTRAINT ck_agent_runs_status CHECK (
        status IN ('pending', 'running', 'cancel_requested',
                   'completed', 'failed', 'cancelled', 'interrupted')),
    CONSTRAINT ck_agent_runs_run_type CHECK (run_type IN ('chat', 'resume', 'subagent')),
    -- The lease is one fact: owner token, heartbeat and expiry are all set or all NULL.
    CONSTRAINT ck_agent_runs_lease_all_or_none CHECK (
        (worker_id IS NULL AND heartbeat_at IS NULL AND lease_expires_at IS NULL)
        OR (worker_id IS NOT NULL AND heartbeat_at IS NOT NULL AND lease_expires_at IS NOT NULL)),
    CONSTRAINT ck_agent_runs_terminal_is_finished CHECK (
        status NOT IN ('completed', 'failed', 'cancelled', 'interrupted')
        OR (finished_at IS NOT NULL AND worker_id IS NULL)),
    CONSTRAINT ck_agent_runs_running_has_lease CHECK (status <> 'running' OR worker_id IS NOT NULL),
    CONSTRAINT ck_agent_runs_manifest_all_or_none CHECK (
        (manifest IS NULL) = (manifest_fingerprint IS NULL)
        AND (manifest IS NULL) = (manifest_recorded_at IS NULL))
)
-- Heartbeats rewrite the row in place: free space in each page lets them be HOT updates.
WITH (fillfactor = 80);

-- One active (non-terminal) run per conversation thread of a user and agent.
CREATE UNIQUE INDEX uq_agent_runs_one_active_per_thread
    ON agent_runs (uid, agent_slug, thread_id)
    WHERE status IN ('pending', 'running', 'cancel_requested');

-- claim_next: oldest claimable run first, read in index order, never a sort of the backlog.
CREATE INDEX ix_agent_runs_claimable
    ON agent_runs (created_at, id)
    WHERE status = 'pending' OR (status = 'cancel_requested' AND worker_id IS NULL);

-- Reconciler: the few live runs, found by their status (the predicate). Keyed by id, so a
-- guarded "UPDATE … WHERE id = $1 AND status IN (live)" is an exact lookup whichever index
-- the planner prefers, never a walk over every live run. Lease columns are deliberately not
-- indexed, so that a lease renewal stays a HOT update.
CREATE INDEX ix_agent_runs_live
    ON agent_runs (id)
    WHERE status IN ('running', 'cancel_requested');

-- Sub-agent lookups and ON DELETE SET NULL of a parent.
CREATE INDEX ix_agent_runs_created_by_run_id
    ON agent_runs (created_by_run_id)
    WHERE created_by_run_id IS NOT NULL;
