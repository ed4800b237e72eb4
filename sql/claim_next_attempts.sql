-- claim_next_attempts: claim_next for up to one run per worker_id, in one statement.
-- from: as claim_next; the first claimable runs not locked by another claimer, at most one each
-- to:   as claim_next for each run; the n-th run in claim order goes to the n-th worker_id
-- returns: each run claimed as it is now, with the attempt_no it opened; no row when none
-- notes: sql/README.md (clock, CASE not IN, data-modifying CTEs, lock order)
WITH clock AS (
    SELECT coalesce(%(now)s::timestamptz, now()) AS now
),
candidate AS (
    -- One priority after the other, each read in ix_agent_runs_claimable order up to now: runs
    -- scheduled for later are never read, the backlog is never sorted.
    SELECT c.id, c.priority, c.available_at, c.concurrency_key
    FROM (VALUES (0), (1), (2), (3), (4), (5), (6), (7), (8), (9)) AS p (priority)
    CROSS JOIN LATERAL (
        SELECT r.id, r.priority, r.available_at, r.concurrency_key
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
              WHERE l.concurrency_key = r.concurrency_key AND l.running >= l.max_running))
        ORDER BY r.available_at, r.id
        LIMIT cardinality(%(worker_ids)s::text[])
        FOR UPDATE SKIP LOCKED
    ) AS c
    LIMIT cardinality(%(worker_ids)s::text[])
),
-- limits per key: the candidates' limit rows, locked after the runs and in key order
-- (sql/README.md, limits); a key admits its candidates in claim order while it has slots.
keyed AS (
    SELECT c.id, c.concurrency_key,
           row_number() OVER (PARTITION BY c.concurrency_key
                               ORDER BY c.priority, c.available_at, c.id) AS rank
    FROM candidate c WHERE c.concurrency_key IS NOT NULL
),
key_slots AS (
    SELECT l.concurrency_key, l.max_running - l.running AS free
    FROM agent_run_limits l
    WHERE l.concurrency_key IN (SELECT k.concurrency_key FROM keyed k)
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
),
expired AS (
    UPDATE agent_run_attempts a
    SET (finished_at, updated_at, outcome, error_type, error_message) =
        (clock.now, clock.now, 'lease_expired', 'worker_lease_expired', %(lost_message)s::text)
    FROM clock
    -- An array of the claimed ids: index lookups, never a walk over every open attempt.
    WHERE a.run_id = ANY (ARRAY(SELECT id FROM lease)) AND a.finished_at IS NULL
    RETURNING a.id
),
opened AS (
    INSERT INTO agent_run_attempts (run_id, attempt_no, worker_id, started_at, heartbeat_at,
                                    lease_expires_at, created_at, updated_at)
    SELECT lease.id, previous.n + 1, lease.worker_id,
           greatest(lease.now, previous.ended), lease.now, lease.expires_at, lease.now, lease.now
    FROM lease,
         -- The run's own attempts only: the FILTER keeps the planner from reading max() backward
         -- off ix_agent_run_attempts_finished, a walk over every finished attempt.
         LATERAL (SELECT coalesce(max(a.attempt_no), 0) AS n,
                         max(a.finished_at) FILTER (WHERE a.finished_at IS NOT NULL) AS ended
                  FROM agent_run_attempts a WHERE a.run_id = lease.id) AS previous
    WHERE (SELECT count(*) FROM expired) >= 0
    RETURNING run_id, attempt_no
)
UPDATE agent_runs r
SET status = CASE WHEN r.status = 'pending' THEN 'running' ELSE r.status END,
    worker_id = lease.worker_id,
    heartbeat_at = lease.now,
    lease_expires_at = lease.expires_at,
    started_at = coalesce(r.started_at, lease.now),
    updated_at = lease.now
FROM lease, opened
WHERE r.id = lease.id AND opened.run_id = lease.id
RETURNING r.*, opened.attempt_no
