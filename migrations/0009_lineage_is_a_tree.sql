-- Lineage is a tree: no run is its own parent, and no re-parenting closes a loop.
--
-- A run that names itself as created_by_run_id never leaves in prune (a tree's root is a run
-- without parent) and keeps everything below it too. The module refuses such a run before any
-- SQL; this keeps it impossible for every client:
-- - ck_agent_runs_not_own_parent (CHECK, check_violation) refuses a self-parent on insert;
-- - agent_runs_lineage_guard refuses an UPDATE that sets created_by_run_id to a run below (or
--   equal to) the run itself. It fires only for statements that write created_by_run_id to
--   another non-NULL value, which the module never does (the foreign key's ON DELETE SET NULL
--   writes NULL): claims, heartbeats and finishes never run it.
--
-- Rows that already break it: a run that is its own parent loses that link (created_by_run_id
-- becomes NULL: a self-link says nothing about where the run came from, and the run becomes the
-- root it already behaved as). A longer loop (only a direct UPDATE could have made one) is cut
-- at its member with the smallest id, which becomes a root. A NOTICE tells how many were cut.
--
-- On a populated table: the CHECK is added NOT VALID (a brief exclusive lock), then validated in
-- a statement of its own (a scan under a lock that lets reads and writes go on). Hence no
-- transaction around the whole; every step can be run again, so a failed run of this migration
-- (a self-parent written by an old client in between) is fixed by running it again.
-- depends: 0008_operator_indexes_skip_live
-- transactional: false

DO $$
DECLARE
    cut bigint;
    loop_member text;
BEGIN
    UPDATE agent_runs SET created_by_run_id = NULL WHERE created_by_run_id = id;
    GET DIAGNOSTICS cut = ROW_COUNT;
    LOOP
        -- UNION, not UNION ALL: a walk ends when it repeats, even through a loop above it.
        WITH RECURSIVE walk (start_id, run_id) AS (
            SELECT id, created_by_run_id FROM agent_runs WHERE created_by_run_id IS NOT NULL
            UNION
            SELECT walk.start_id, parent.created_by_run_id
            FROM walk JOIN agent_runs AS parent ON parent.id = walk.run_id
            WHERE parent.created_by_run_id IS NOT NULL AND walk.run_id <> walk.start_id
        )
        SELECT min(start_id) INTO loop_member FROM walk WHERE run_id = start_id;
        EXIT WHEN loop_member IS NULL;
        UPDATE agent_runs SET created_by_run_id = NULL WHERE id = loop_member;
        cut := cut + 1;
    END LOOP;
    IF cut > 0 THEN
        RAISE NOTICE 'agent_runs: % lineage link(s) that made a run its own ancestor set to NULL',
            cut;
    END IF;
END
$$;

DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_constraint
                   WHERE conname = 'ck_agent_runs_not_own_parent'
                     AND conrelid = 'agent_runs'::regclass) THEN
        ALTER TABLE agent_runs ADD CONSTRAINT ck_agent_runs_not_own_parent
            CHECK (created_by_run_id <> id) NOT VALID;
    END IF;
END
$$;

ALTER TABLE agent_runs VALIDATE CONSTRAINT ck_agent_runs_not_own_parent;

CREATE OR REPLACE FUNCTION agent_runs_lineage_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    -- Re-parenting updates take turns (they are rare: the module never makes one), and each
    -- walk below then sees the others' committed links: two concurrent updates cannot close a
    -- loop that neither sees.
    PERFORM pg_advisory_xact_lock(hashtext('agent_runs_lineage_guard'));
    -- Walk up from the new parent: reaching this run means the update closes a loop.
    IF EXISTS (
        WITH RECURSIVE ancestors (id, parent) AS (
            SELECT id, created_by_run_id FROM agent_runs WHERE id = NEW.created_by_run_id
            UNION
            SELECT run.id, run.created_by_run_id
            FROM ancestors JOIN agent_runs AS run ON run.id = ancestors.parent
        )
        SELECT FROM ancestors WHERE id = NEW.id
    ) THEN
        RAISE EXCEPTION 'run id=%: created_by_run_id % would make the run its own ancestor',
            NEW.id, NEW.created_by_run_id
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS agent_runs_lineage_guard ON agent_runs;
CREATE TRIGGER agent_runs_lineage_guard
    AFTER UPDATE OF created_by_run_id ON agent_runs
    FOR EACH ROW
    WHEN (NEW.created_by_run_id IS NOT NULL
          AND NEW.created_by_run_id IS DISTINCT FROM OLD.created_by_run_id)
    EXECUTE FUNCTION agent_runs_lineage_guard();
