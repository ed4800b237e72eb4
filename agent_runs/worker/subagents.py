"""Sub-agent runs started from an agent's context: their ids, derived so a retried or resumed
parent finds the child it started before, and the wait for a child that ends with the parent's
stop.

A child's `request_id` and `thread_id` are `subagent:` and 40 hex digits of the SHA-256 of the
parent's run id and the call's key (49 characters, within the 64 allowed). The key is the
caller's, or the call's order within the attempt (`#1`, `#2`, ...) prefixed by a scope that an
agent adapter sets (a LangGraph node: its task's namespace), so the same call in the next
attempt of the parent derives the same ids, and `create_run`'s idempotency returns that child.
The child's thread is its own: it never collides with the parent's active thread.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Final

from agent_runs import validation as check
from agent_runs.backoff import Backoff
from agent_runs.errors import InvalidArgument
from agent_runs.models import AgentRun

PREFIX: Final = "subagent:"
# A key is hashed, so only its sanity is bounded.
MAX_KEY_LENGTH: Final = 4096
# How often a waiting parent reads its child: from the first interval up to the cap.
POLL_FIRST_SECONDS: Final = 0.05
POLL_CAP_SECONDS: Final = 0.5


def child_ids(parent_run_id: str, key: str) -> str:
    """The request_id (and default thread_id) of the parent's child for `key`."""
    digest = hashlib.sha256(f"{parent_run_id}\x00{key}".encode()).hexdigest()
    return PREFIX + digest[:40]


def checked_key(key: object) -> str:
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise InvalidArgument(f"key must be a string of 1 to {MAX_KEY_LENGTH} characters")
    if "\x00" in key:
        raise InvalidArgument("key must not contain NUL characters")
    return key


def wait_for_child(
    run_id: str,
    read: Callable[[], AgentRun | None],
    should_stop: Callable[[], bool],
    sleep: Callable[[float], bool],
    timeout_seconds: float,
) -> AgentRun:
    """Read the child until it is final (returned), the parent should stop (the child as it is
    now), or `timeout_seconds` pass (TimeoutError). `sleep(s)` returns True once the parent
    should stop."""
    timeout = check.timeout_seconds(timeout_seconds)
    deadline = time.monotonic() + timeout
    backoff = Backoff(initial=POLL_FIRST_SECONDS, cap=POLL_CAP_SECONDS)
    while True:
        child = read()
        if child is None:
            raise InvalidArgument(f"run_id {run_id!r}: no such run")
        if child.is_terminal or should_stop():
            return child
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"run {run_id} is still {child.status} after {timeout:g}s")
        if sleep(min(backoff.next_delay(), left)):
            return read() or child
