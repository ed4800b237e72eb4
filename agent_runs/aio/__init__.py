"""agent_runs for asyncio: the repository's calls as coroutines, over psycopg's AsyncConnection.

```python
from agent_runs import aio

async with aio.create_pool(dsn) as pool, pool.connection() as conn:
    repo = aio.AsyncAgentRunRepository(conn)
    run = await repo.create_run(thread_id="t", agent_slug="a", uid="u", request_id="r")
    done = await aio.wait_for_run(conn, run.id, timeout_seconds=60)
```

The same plans as the synchronous AgentRunRepository (agent_runs.steps): same sql/ files,
checks, values and errors, one round trip per transition.
"""

from __future__ import annotations

from agent_runs.aio.db import connect, create_pool
from agent_runs.aio.notify import wait_for_run
from agent_runs.aio.repository import AsyncAgentRunRepository

__all__ = ["AsyncAgentRunRepository", "connect", "create_pool", "wait_for_run"]
