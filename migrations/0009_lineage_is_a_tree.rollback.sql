-- Drops 0009's lineage guards; the data stays (links cut by 0009 are not restored).
-- transactional: false

DROP TRIGGER IF EXISTS agent_runs_lineage_guard ON agent_runs;
DROP FUNCTION IF EXISTS agent_runs_lineage_guard();
ALTER TABLE agent_runs DROP CONSTRAINT IF EXISTS ck_agent_runs_not_own_parent;
