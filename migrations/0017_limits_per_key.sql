-- Concurrency limits per key: agent_runs.concurrency_key, agent_run_limits and its counter.
--
-- A run may carry a concurrency_key (a user, an agent, a model provider: 1-128 characters).
-- A key with a row in agent_run_limits has at most max_running runs counted at any instant:
-- counted = running, or cancel_requested with an owner. `running` is that count, kept in the
-- same transaction as every change of a counted state by the trigger below, whoever writes the
-- run (the repository's statements, a requeue, a raw UPDATE or DELETE): no claim ever counts a
-- key's history. A claim locks the limit rows of its candidates' keys (FOR UPDATE, in key
-- order, after the run rows) and admits a run only while running < max_running; the trigger
-- then raises the count before that lock is released at commit, so concurrent claimers of one
-- key take turns on its row and can never both take its last slot.
--
-- Lock order: run rows first, then limit rows in key order. Statements that end many runs
-- lock their keys' rows in key order before the trigger (which fires at the end of the
-- statement) touches them. set_limit creates a row under an exclusive advisory lock on the key
-- and counts the key's live runs; the trigger takes the shared one only when it finds no row,
-- so a count never misses a transition that commits while the row is being created.
--
-- A run of a limited key that leaves the counted states and frees its key's last slot wakes a
-- worker (agent_runs_claimable, payload the agent_slug of the key's oldest waiting run), and
-- only then: notifying transactions serialize their commits.
--
-- Cost for runs without a key: the triggers' WHEN is false (an UPDATE that names none of
-- status, worker_id, concurrency_key, such as a lease renewal, does not even evaluate it), and
-- the new index holds keyed runs only, so renewals stay HOT.
--
-- On a populated table: ADD COLUMN without a default is a catalog change; the CHECK is added
-- NOT VALID (no scan under the ACCESS EXCLUSIVE lock) and validated after; the partial index
-- is empty for existing runs (they have no key); agent_run_limits is a new empty table.
-- depends: 0014_requeues_and_policies 0015_run_output_and_resumed_from

ALTER TABLE agent_runs ADD COLUMN concurrency_key text NULL;

ALTER TABLE agent_runs ADD CONSTRAINT ck_agent_runs_concurrency_key CHECK (
    concurrency_key IS NULL OR char_length(concurrency_key) BETWEEN 1 AND 128) NOT VALID;

ALTER TABLE agent_runs VALIDATE CONSTRAINT ck_agent_runs_concurrency_key;

-- A key's active runs in claim order: its waiting runs (list_limits, the wake-up's slug) and
-- its live ones (set_limit's count). Only keyed runs have entries; no lease column.
CREATE INDEX ix_agent_runs_key_active
    ON agent_runs (concurrency_key, created_at, id)
    WHERE concurrency_key IS NOT NULL
      AND status IN ('pending', 'running', 'cancel_requested');

CREATE TABLE agent_run_limits (
    concurrency_key text        PRIMARY KEY,
    max_running     integer     NOT NULL,
    -- The key's counted runs now, kept by agent_run_limits_count(); never read for a claim
    -- without the row's lock.
    running         integer     NOT NULL DEFAULT 0,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT ck_agent_run_limits_key CHECK (char_length(concurrency_key) BETWEEN 1 AND 128),
    CONSTRAINT ck_agent_run_limits_max_running CHECK (max_running >= 0)
)
-- The counter is rewritten by every counted transition of the key: HOT updates.
WITH (fillfactor = 50);

CREATE FUNCTION agent_run_limits_bump(p_key text, p_delta integer) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    now_running integer;
    limit_running integer;
    slug text;
BEGIN
    -- Never below zero: a counter is a fact about runs, and an end must never fail on it.
    UPDATE agent_run_limits SET running = greatest(0, running + p_delta)
    WHERE concurrency_key = p_key
    RETURNING running, max_running INTO now_running, limit_running;
    IF NOT FOUND THEN
        -- No limit (or one being created): wait for a set_limit of this key in flight, then
        -- look again with a new snapshot.
        PERFORM pg_advisory_xact_lock_shared(hashtext('agent_run_limits'), hashtext(p_key));
        UPDATE agent_run_limits SET running = greatest(0, running + p_delta)
        WHERE concurrency_key = p_key
        RETURNING running, max_running INTO now_running, limit_running;
        IF NOT FOUND THEN
            RETURN;
        END IF;
    END IF;
    -- This end freed the key's last slot: wake a worker for its oldest waiting run.
    IF p_delta < 0 AND now_running < limit_running AND now_running - p_delta >= limit_running THEN
        SELECT r.agent_slug INTO slug
        FROM agent_runs r
        WHERE r.concurrency_key = p_key
          AND r.status IN ('pending', 'running', 'cancel_requested')
          AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
        ORDER BY r.created_at, r.id
        LIMIT 1;
        IF slug IS NOT NULL THEN
            PERFORM pg_notify('agent_runs_claimable', slug);
        END IF;
    END IF;
END;
$$;

CREATE FUNCTION agent_run_limits_count() RETURNS trigger
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    was boolean := false;
    now_counted boolean := false;
BEGIN
    IF TG_OP <> 'INSERT' THEN
        was := OLD.concurrency_key IS NOT NULL
               AND (OLD.status = 'running'
                    OR (OLD.status = 'cancel_requested' AND OLD.worker_id IS NOT NULL));
    END IF;
    IF TG_OP <> 'DELETE' THEN
        now_counted := NEW.concurrency_key IS NOT NULL
                       AND (NEW.status = 'running'
                            OR (NEW.status = 'cancel_requested' AND NEW.worker_id IS NOT NULL));
    END IF;
    IF was AND now_counted AND OLD.concurrency_key = NEW.concurrency_key THEN
        RETURN NULL;
    END IF;
    IF was THEN
        PERFORM agent_run_limits_bump(OLD.concurrency_key, -1);
    END IF;
    IF now_counted THEN
        PERFORM agent_run_limits_bump(NEW.concurrency_key, 1);
    END IF;
    RETURN NULL;
END;
$$;

CREATE TRIGGER agent_run_limits_count_insert
    AFTER INSERT ON agent_runs
    FOR EACH ROW
    WHEN (NEW.concurrency_key IS NOT NULL AND NEW.status IN ('running', 'cancel_requested'))
    EXECUTE FUNCTION agent_run_limits_count();

CREATE TRIGGER agent_run_limits_count_update
    AFTER UPDATE OF status, worker_id, concurrency_key ON agent_runs
    FOR EACH ROW
    WHEN ((OLD.concurrency_key IS NOT NULL OR NEW.concurrency_key IS NOT NULL)
          AND ((OLD.status = 'running'
                OR (OLD.status = 'cancel_requested' AND OLD.worker_id IS NOT NULL))
               IS DISTINCT FROM
               (NEW.status = 'running'
                OR (NEW.status = 'cancel_requested' AND NEW.worker_id IS NOT NULL))
               OR OLD.concurrency_key IS DISTINCT FROM NEW.concurrency_key))
    EXECUTE FUNCTION agent_run_limits_count();

CREATE TRIGGER agent_run_limits_count_delete
    AFTER DELETE ON agent_runs
    FOR EACH ROW
    WHEN (OLD.concurrency_key IS NOT NULL AND OLD.status IN ('running', 'cancel_requested'))
    EXECUTE FUNCTION agent_run_limits_count();
