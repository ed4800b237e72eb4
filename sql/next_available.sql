-- next_available: how long until the next run scheduled for later becomes claimable.
-- from: pending | ownerless cancel_requested with available_at > now, of agent_slugs if given,
--       not parked behind a full key
-- to:   nothing (read only)
-- returns: one row, seconds (NULL when no run is scheduled), by the database's clock
-- notes: sql/README.md (clock); one probe of ix_agent_runs_claimable per priority
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
)
SELECT extract(epoch FROM min(c.available_at) - (SELECT now FROM clock))::float8 AS seconds
FROM (VALUES (0), (1), (2), (3), (4), (5), (6), (7), (8), (9)) AS p (priority)
CROSS JOIN LATERAL (
    SELECT r.available_at
    FROM agent_runs r
    WHERE r.priority = p.priority
      AND r.available_at > (SELECT now FROM clock)
      AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
      AND CASE WHEN %(agent_slugs)s::text[] IS NULL THEN true
               ELSE r.agent_slug = ANY (%(agent_slugs)s::text[]) END
      -- limits per key: a full key's parked runs wait for its slot (whose end wakes a worker)
      AND NOT r.key_waiting
    ORDER BY r.available_at, r.id
    LIMIT 1
) AS c
