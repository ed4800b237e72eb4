-- set_limit.lock: wait for the key's transitions in flight, then hold them off until commit.
-- from: any key
-- to:   nothing: an exclusive advisory lock on the key for this transaction; the counter's
--       trigger takes the shared one when it finds no limit row, so set_limit's count sees
--       every transition committed before it and the trigger counts every one after
-- returns: one row
SELECT pg_advisory_xact_lock(hashtext('agent_run_limits'), hashtext(%(concurrency_key)s::text))
