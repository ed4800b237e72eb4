-- The JSON guard on updates as an AFTER UPDATE trigger that fires only when a JSON column changed.
--
-- Any BEFORE UPDATE row trigger makes PostgreSQL lock each updated row before it looks at the
-- trigger's column list: every claim, renewal and finish of a run wrote a row-lock WAL record
-- for 0003's `BEFORE INSERT OR UPDATE OF input_payload, manifest` guard. Inserts stay guarded
-- BEFORE; an update is refused AFTER, by the same function, with the same SQLSTATE
-- (check_violation): the statement fails at its end and nothing it wrote stays.
--
-- On a populated table: DROP/CREATE TRIGGER take a SHARE ROW EXCLUSIVE lock on agent_runs for
-- the few milliseconds of this transaction (no scan, no rewrite); writers wait for it, readers
-- do not. One transaction: the table is never unguarded.
-- depends: 0005_attempt_update_guard

DROP TRIGGER agent_runs_json_guard ON agent_runs;

CREATE TRIGGER agent_runs_json_guard
    BEFORE INSERT ON agent_runs
    FOR EACH ROW EXECUTE FUNCTION agent_runs_json_guard();

CREATE TRIGGER agent_runs_json_update_guard
    AFTER UPDATE OF input_payload, manifest ON agent_runs
    FOR EACH ROW
    WHEN (NEW.input_payload IS DISTINCT FROM OLD.input_payload
          OR NEW.manifest IS DISTINCT FROM OLD.manifest)
    EXECUTE FUNCTION agent_runs_json_guard();
