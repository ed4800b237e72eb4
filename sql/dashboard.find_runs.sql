-- dashboard.find_runs: runs whose id starts with a prefix (the runs page's "go to run" box).
-- from: runs by primary key, from the prefix upwards
-- to:   nothing (read only)
-- returns: (id, status, agent_slug, created_at), at most limit rows, in id order
-- notes: a range scan of agent_runs_pkey; the upper bound is the prefix followed by the
--        highest code point, so the scan stops past the prefix's ids (exact under the C and
--        C.UTF-8 collations; starts_with keeps the answer right under any other).
SELECT r.id, r.status, r.agent_slug, r.created_at
FROM agent_runs r
WHERE r.id >= %(prefix)s::text
  AND r.id < %(prefix)s::text || U&'\+10FFFF'
  AND starts_with(r.id, %(prefix)s::text)
ORDER BY r.id
LIMIT %(limit)s
