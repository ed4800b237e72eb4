-- claim_next.released: when the attempts before just-claimed retries ended (telemetry only).
-- from: the claimed runs, by id and the attempt_no each claim opened
-- to:   nothing (read only)
-- returns: (run_id, finished_at) of each claimed attempt's predecessor, for pickup.duration
SELECT a.run_id, a.finished_at
FROM unnest(%(run_ids)s::text[], %(attempt_nos)s::int[]) AS c (run_id, attempt_no)
JOIN agent_run_attempts a ON a.run_id = c.run_id AND a.attempt_no = c.attempt_no - 1
