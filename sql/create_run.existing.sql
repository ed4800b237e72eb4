-- create_run.existing: the run an earlier request with this request_id created.
-- from: any run
-- to:   nothing (read only; a new statement, whose snapshot sees a concurrent creator's commit)
-- returns: that run, no row when there is none
SELECT * FROM agent_runs WHERE request_id = %(request_id)s
