-- set_policy: write an agent slug's recovery policy (every field, merged by the caller).
-- from: any (a new row, or the slug's row)
-- to:   the slug's row with these values, updated_at = now
-- returns: the row as written
INSERT INTO agent_run_policies AS p (agent_slug, max_attempts, max_lost_leases, backoff_seconds,
                                     backoff_max_seconds, backoff_jitter, deadline_seconds,
                                     updated_at)
VALUES (%(agent_slug)s::text, %(max_attempts)s::int, %(max_lost_leases)s::int,
        %(backoff_seconds)s::float8, %(backoff_max_seconds)s::float8,
        %(backoff_jitter)s::float8, %(deadline_seconds)s::float8, now())
ON CONFLICT (agent_slug) DO UPDATE
SET (max_attempts, max_lost_leases, backoff_seconds, backoff_max_seconds, backoff_jitter,
     deadline_seconds, updated_at) =
    (EXCLUDED.max_attempts, EXCLUDED.max_lost_leases, EXCLUDED.backoff_seconds,
     EXCLUDED.backoff_max_seconds, EXCLUDED.backoff_jitter, EXCLUDED.deadline_seconds, now())
RETURNING p.agent_slug AS source, p.*
