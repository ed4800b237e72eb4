"""Every limit of the module in one place: lengths, ranges, the time window, batch sizes."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Final

MAX_ID_LENGTH: Final = 64
MAX_WORKER_ID_LENGTH: Final = 128
# Where an attempt resumed (a LangGraph checkpoint id is a 36-character UUID).
MAX_CHECKPOINT_ID_LENGTH: Final = 128
# A concurrency key (user:u-7, provider:openai): 1-128 characters; a limit fits an int column.
MAX_CONCURRENCY_KEY_LENGTH: Final = 128
MAX_RUNNING_LIMIT: Final = 2_147_483_647
# Owner tokens are f"{name}:{uuid4().hex}": the name leaves room for ":" and 32 hex digits.
MAX_WORKER_NAME_LENGTH: Final = MAX_WORKER_ID_LENGTH - 33
MAX_ERROR_TYPE_LENGTH: Final = 64
MAX_ERROR_MESSAGE_LENGTH: Final = 8192
MAX_LEASE_SECONDS: Final = 86400
MAX_POLL_SECONDS: Final = 3600
# A wait longer than a year is a mistake, not a plan (and keeps deadlines far from overflow).
MAX_TIMEOUT_SECONDS: Final = 366 * 86400
MAX_TRIES: Final = 1_000_000
# Threads of one `agent-runs worker` process (each may hold a pooled database connection).
MAX_CONCURRENCY: Final = 1000
MAX_LIMIT: Final = 100_000
MAX_BATCH: Final = 1000  # runs per claim_next_attempts / finish_runs call
MAX_DSN_LENGTH: Final = 4096
MAX_JSON_DEPTH: Final = 64
# A run's output, in bytes of its JSON text (UTF-8). A result is read whole by every get_run and
# wait_for_run and sent to every waiter: 1 MiB holds a long conversation's final state; larger
# artifacts belong in object storage, the output naming them.
MAX_OUTPUT_BYTES: Final = 1 << 20
# Python refuses to print ints of more than 4,300 digits by default; jsonb would keep them,
# but they could not be read back. One bound below both.
MAX_JSON_INT: Final = 10**4000
# The window of every timestamp the schema accepts: [TIME_MIN, TIME_MAX).
TIME_MIN: Final = datetime(2000, 1, 1, tzinfo=UTC)
TIME_MAX: Final = datetime(9000, 1, 1, tzinfo=UTC)
INVALID_ERROR_TYPE: Final = "invalid_error_type"
# An invalid error_type is kept in the message as the first this-many characters of its repr.
MAX_BAD_ERROR_TYPE_SHOWN: Final = 100
RUN_TYPES: Final = frozenset({"chat", "resume", "subagent"})
