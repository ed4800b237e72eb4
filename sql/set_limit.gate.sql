-- set_limit.gate: park or bring back the key's waiting runs after its limit changed.
-- from: the key's waiting runs (pending, ownerless cancel_requested); in the limit's transaction
-- to:   key full: all parked (key_waiting, out of the claim index); slots free: up to that many
--       of the oldest back; no limit: all back (agent_run_limits_gate, migration 0018)
-- returns: one row
SELECT agent_run_limits_gate(%(concurrency_key)s::text)
