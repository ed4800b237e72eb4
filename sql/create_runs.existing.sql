-- create_runs.existing: the runs that earlier requests with these request_ids created.
-- from: any run
-- to:   nothing (read only; a new statement, whose snapshot sees a concurrent creator's commit)
-- returns: those runs; a request_id with no run has no row
SELECT * FROM agent_runs WHERE request_id = ANY (%(request_ids)s::text[])
