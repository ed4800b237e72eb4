-- Back to 0017: claims pass over a full key's runs in the claim index (rebuilt without
-- `AND NOT key_waiting`), the counter without the gate.

DROP TRIGGER agent_run_limits_regate_update ON agent_runs;
DROP FUNCTION agent_run_limits_regate();
DROP TRIGGER agent_run_limits_park_insert ON agent_runs;
DROP FUNCTION agent_run_limits_park_new();

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

DROP FUNCTION agent_run_limits_gate(text);
DROP INDEX ix_agent_runs_key_parked_available;
DROP INDEX ix_agent_runs_key_parked;
DROP INDEX ix_agent_runs_key_unparked;

DO $$
DECLARE
    claim_index record;
BEGIN
    FOR claim_index IN
        SELECT i.indexrelid::regclass AS name, pg_get_indexdef(i.indexrelid) AS definition
        FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE i.indrelid = 'agent_runs'::regclass AND NOT i.indisunique
          AND c.relname LIKE '%claim%'
          AND pg_get_expr(i.indpred, i.indrelid) LIKE '%key_waiting%'
    LOOP
        EXECUTE format('DROP INDEX %s', claim_index.name);
        EXECUTE regexp_replace(
            regexp_replace(claim_index.definition, ' AND \(NOT key_waiting\)\)$', ''),
            ' WHERE \(', ' WHERE ');
    END LOOP;
END
$$;

ALTER TABLE agent_runs DROP COLUMN key_waiting;
