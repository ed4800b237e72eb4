-- list_runs.whole: the whole rows of a page that list_runs listed, in the page's order.
-- from: any run among ids
-- to:   nothing (read only)
-- returns: one row per id still stored (a run pruned since the listing is left out)
SELECT r.*
FROM unnest(%(ids)s::text[]) WITH ORDINALITY AS listed(id, position)
JOIN agent_runs r ON r.id = listed.id
ORDER BY listed.position
