-- claim_admission: which of many candidates their keys admit, and the lease of each admitted
-- one: the n-th candidate in claim order goes to the n-th of %(worker_ids)s.
-- slots: freed?, also_keys? (a key's slots this statement's own ends free, and those keys)
-- notes: sql/README.md (limits per key, lock order)

-- limits per key: the candidates' limit rows, locked after the runs and in key order
-- (sql/README.md, limits); a key admits its candidates in claim order while it has slots.
keyed AS (
    SELECT c.id, c.concurrency_key,
           row_number() OVER (PARTITION BY c.concurrency_key
                               ORDER BY c.priority, c.available_at, c.id) AS rank
    FROM candidate c WHERE c.concurrency_key IS NOT NULL
),
key_slots AS (
    SELECT l.concurrency_key,
           l.max_running - l.running{{freed?}} AS free
    FROM agent_run_limits l
    WHERE l.concurrency_key IN (SELECT k.concurrency_key FROM keyed k{{also_keys?}})
    ORDER BY l.concurrency_key
    FOR UPDATE
),
over_limit AS (
    SELECT keyed.id FROM keyed JOIN key_slots USING (concurrency_key)
    WHERE keyed.rank > key_slots.free
),
lease AS (
    SELECT c.id, owner.worker_id, clock.now,
           clock.now + make_interval(secs => %(lease_seconds)s::float8) AS expires_at
    FROM (SELECT id, row_number() OVER (ORDER BY priority, available_at, id) AS n
          FROM candidate) AS c
    JOIN unnest(%(worker_ids)s::text[]) WITH ORDINALITY AS owner (worker_id, n) USING (n)
    CROSS JOIN clock
    WHERE NOT EXISTS (SELECT FROM over_limit WHERE over_limit.id = c.id)  -- limits per key
)
