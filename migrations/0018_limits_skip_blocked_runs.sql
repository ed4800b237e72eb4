-- Limits per key: a claim never walks the runs of a full key (agent_runs.key_waiting).
--
-- A claim reads the claim index in order and passes over runs whose key is at its limit; with
-- 100,000 such runs ahead of the first claimable one it would read them all, each time. Here a
-- full key's waiting runs leave the claim index instead: key_waiting = true ("parked") takes a
-- pending run out of its predicate, and the claims add `NOT key_waiting` to their filter. The
-- run keeps its (priority, available_at, id), so it comes back to its own place.
--
-- agent_run_limits_gate(key), called under the key row's lock by the counter (whenever a run
-- of the key leaves the counted states, and when one fills the key's last slot), by set_limit
-- and by delete_limit, keeps it so:
-- - key full (running >= max_running): every waiting run of the key parked;
-- - slots free: up to that many of its parked runs back in the claim index, in claim order
--   (priority, available_at, id), those available now first; no limit any more: all back.
-- A run created while its key is full is parked by a BEFORE INSERT trigger that holds the key
-- row FOR SHARE until commit (so the end that frees a slot waits, then sees it); a parked run
-- made pending again by a requeue or a raw UPDATE has its key gated again. Every lock
-- these take on runs is SKIP LOCKED: a run another transaction holds is left as it is, and the
-- claims' anti-join against full keys still passes over it (a few rows, never the backlog).
--
-- On a populated table: ADD COLUMN with a constant default is a catalog change; the claim
-- index is rebuilt (CREATE INDEX under a SHARE lock: writes wait while it builds) from its own
-- definition with `AND NOT key_waiting` appended, whatever its columns; two partial indexes
-- over keyed pending runs only (empty for runs without a key).
-- depends: 0017_limits_per_key

ALTER TABLE agent_runs ADD COLUMN key_waiting boolean NOT NULL DEFAULT false;

DO $$
DECLARE
    claim_index record;
BEGIN
    FOR claim_index IN
        SELECT i.indexrelid::regclass AS name, pg_get_indexdef(i.indexrelid) AS definition
        FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE i.indrelid = 'agent_runs'::regclass AND NOT i.indisunique
          AND c.relname LIKE '%claim%'
          AND pg_get_expr(i.indpred, i.indrelid) LIKE '%pending%'
    LOOP
        EXECUTE format('DROP INDEX %s', claim_index.name);
        EXECUTE regexp_replace(claim_index.definition, ' WHERE (.*)$',
                               ' WHERE ((\1) AND (NOT key_waiting))');
    END LOOP;
END
$$;

-- A full key's waiting runs not parked yet (parked when it fills).
CREATE INDEX ix_agent_runs_key_unparked
    ON agent_runs (concurrency_key)
    WHERE concurrency_key IS NOT NULL AND NOT key_waiting
      AND (status = 'pending' OR (status = 'cancel_requested' AND worker_id IS NULL));

-- A key's parked runs in claim order (the first come back first when slots free).
CREATE INDEX ix_agent_runs_key_parked
    ON agent_runs (concurrency_key, priority, available_at, id)
    WHERE key_waiting
      AND (status = 'pending' OR (status = 'cancel_requested' AND worker_id IS NULL));

-- Parked runs by availability: those scheduled for later are listed (list_scheduled_runs)
-- without the claim index, which leaves them out.
CREATE INDEX ix_agent_runs_key_parked_available
    ON agent_runs (available_at, id)
    WHERE key_waiting
      AND (status = 'pending' OR (status = 'cancel_requested' AND worker_id IS NULL));

CREATE FUNCTION agent_run_limits_gate(p_key text) RETURNS void
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    free_slots bigint;
    brought_back bigint;
BEGIN
    SELECT l.max_running - l.running INTO free_slots
    FROM agent_run_limits l WHERE l.concurrency_key = p_key;
    IF FOUND AND free_slots <= 0 THEN
        UPDATE agent_runs SET key_waiting = true
        WHERE id IN (
            SELECT r.id FROM agent_runs r
            WHERE r.concurrency_key = p_key AND NOT r.key_waiting
              AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
            FOR UPDATE SKIP LOCKED);
    ELSE
        -- In claim order, the runs available now first: a slot never waits on a run scheduled
        -- for later while an available one of its key stays parked.
        UPDATE agent_runs SET key_waiting = false
        WHERE id IN (
            SELECT r.id FROM agent_runs r
            WHERE r.concurrency_key = p_key AND r.key_waiting
              AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
              AND r.available_at <= now()
            ORDER BY r.priority, r.available_at, r.id
            LIMIT free_slots  -- NULL (no limit): every one
            FOR UPDATE SKIP LOCKED);
        GET DIAGNOSTICS brought_back = ROW_COUNT;
        -- Slots left: the runs scheduled for later too (each is claimable once available).
        IF free_slots IS NULL OR brought_back < free_slots THEN
            UPDATE agent_runs SET key_waiting = false
            WHERE id IN (
                SELECT r.id FROM agent_runs r
                WHERE r.concurrency_key = p_key AND r.key_waiting
                  AND (r.status = 'pending'
                       OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
                ORDER BY r.priority, r.available_at, r.id
                LIMIT free_slots - brought_back
                FOR UPDATE SKIP LOCKED);
        END IF;
    END IF;
END;
$$;

CREATE OR REPLACE FUNCTION agent_run_limits_bump(p_key text, p_delta integer) RETURNS void
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
    -- The key's parked runs follow its slots: parked when it fills, back when slots free.
    IF p_delta < 0 OR now_running >= limit_running THEN
        PERFORM agent_run_limits_gate(p_key);
    END IF;
    -- This end freed the key's last slot: wake a worker for the first run the gate brought
    -- back that is available now (claim order; the key was full, so those are few), if any.
    IF p_delta < 0 AND now_running < limit_running AND now_running - p_delta >= limit_running THEN
        SELECT r.agent_slug INTO slug
        FROM agent_runs r
        WHERE r.concurrency_key = p_key AND NOT r.key_waiting
          AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
          AND r.available_at <= now()
        ORDER BY r.priority, r.available_at, r.id
        LIMIT 1;
        IF slug IS NOT NULL THEN
            PERFORM pg_notify('agent_runs_claimable', slug);
        END IF;
    END IF;
END;
$$;

CREATE FUNCTION agent_run_limits_park_new() RETURNS trigger
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- SKIP LOCKED: a key row a claim or an end holds is never waited for (no lock cycle with
    -- them); the run then starts unparked and the claims' anti-join passes over it.
    PERFORM FROM agent_run_limits l
    WHERE l.concurrency_key = NEW.concurrency_key AND l.running >= l.max_running
    FOR SHARE SKIP LOCKED;
    IF FOUND THEN
        NEW.key_waiting := true;
    END IF;
    RETURN NEW;
END;
$$;

CREATE TRIGGER agent_run_limits_park_insert
    BEFORE INSERT ON agent_runs
    FOR EACH ROW
    WHEN (NEW.concurrency_key IS NOT NULL AND NEW.status = 'pending')
    EXECUTE FUNCTION agent_run_limits_park_new();

CREATE FUNCTION agent_run_limits_regate() RETURNS trigger
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    -- The key row first (shared), so an end freeing a slot waits for this and sees the run.
    PERFORM FROM agent_run_limits l WHERE l.concurrency_key = NEW.concurrency_key FOR SHARE;
    PERFORM agent_run_limits_gate(NEW.concurrency_key);
    RETURN NULL;
END;
$$;

-- A parked run that becomes pending again by another way than a claim's end (a requeue, a raw
-- UPDATE): its key is gated again, so it is never left parked while its key has a free slot.
CREATE TRIGGER agent_run_limits_regate_update
    AFTER UPDATE OF status ON agent_runs
    FOR EACH ROW
    WHEN (NEW.key_waiting AND NEW.status = 'pending' AND OLD.status <> 'pending')
    EXECUTE FUNCTION agent_run_limits_regate();
