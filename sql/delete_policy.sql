-- delete_policy: remove an agent slug's recovery policy (its runs then follow '*' or built-in).
-- from: the slug's row
-- to:   deleted
-- returns: the slug when a row was deleted, no row otherwise
DELETE FROM agent_run_policies WHERE agent_slug = %(agent_slug)s::text RETURNING agent_slug
