-- list_scheduled_runs: pending runs not yet available, the soonest first.
-- from: pending | ownerless cancel_requested whose available_at > now
-- to:   nothing (read only)
-- returns: up to limit runs by (available_at, id), through ix_agent_runs_claimable and the
--          parked runs' index
-- notes: sql/README.md (clock)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
)
SELECT r.*
FROM (
    (SELECT r.*
     FROM (VALUES (0), (1), (2), (3), (4), (5), (6), (7), (8), (9)) AS p (priority)
     CROSS JOIN LATERAL (
         SELECT r.*
         FROM agent_runs r
         WHERE r.priority = p.priority
           AND r.available_at > (SELECT now FROM clock)
           AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
           AND CASE WHEN %(agent_slug)s::text IS NULL THEN true
                    ELSE r.agent_slug = %(agent_slug)s::text END
           AND NOT r.key_waiting  -- limits per key: the claim index's runs
         ORDER BY r.available_at, r.id
         LIMIT %(limit)s
     ) AS r)
    UNION ALL
    -- limits per key: runs parked behind a full key (ix_agent_runs_key_parked_available)
    (SELECT r.*
     FROM agent_runs r
     WHERE r.key_waiting
       AND r.available_at > (SELECT now FROM clock)
       AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
       AND CASE WHEN %(agent_slug)s::text IS NULL THEN true
                ELSE r.agent_slug = %(agent_slug)s::text END
     ORDER BY r.available_at, r.id
     LIMIT %(limit)s)
) AS r
ORDER BY r.available_at, r.id
LIMIT %(limit)s
