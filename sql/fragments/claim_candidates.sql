-- claim_candidates: the `candidate` CTE of every claim: the first claimable runs in claim order
-- (priority, available_at, id), locked FOR UPDATE SKIP LOCKED; a full key's runs passed over.
-- slots: columns, run_columns (what it keeps, as c.… and r.…); limit (how many runs at most);
--        unless? (more lines of the full-key test: a key the statement's own ends free)
-- notes: sql/README.md (claim order, limits per key)

candidate AS (
    -- One priority after the other, each read in ix_agent_runs_claimable order up to now: runs
    -- scheduled for later are never read, the backlog is never sorted.
    SELECT {{columns}}
    FROM (VALUES (0), (1), (2), (3), (4), (5), (6), (7), (8), (9)) AS p (priority)
    CROSS JOIN LATERAL (
        SELECT {{run_columns}}
        FROM agent_runs r
        WHERE r.priority = p.priority
          -- available by the given clock or the database's, whichever is later
          AND r.available_at <= (SELECT greatest(now, now()) FROM clock)
          AND (r.status = 'pending' OR (r.status = 'cancel_requested' AND r.worker_id IS NULL))
          AND CASE WHEN %(agent_slugs)s::text[] IS NULL THEN true
                   ELSE r.agent_slug = ANY (%(agent_slugs)s::text[]) END
          -- limits per key: a run of a key at its limit is passed over, keeping its place.
          AND NOT r.key_waiting
          AND (r.concurrency_key IS NULL OR NOT EXISTS (
              SELECT FROM agent_run_limits l
              WHERE l.concurrency_key = r.concurrency_key AND l.running >= l.max_running{{unless?}}))
        ORDER BY r.available_at, r.id
        LIMIT {{limit}}
        FOR UPDATE SKIP LOCKED
    ) AS c
    LIMIT {{limit}}
)
