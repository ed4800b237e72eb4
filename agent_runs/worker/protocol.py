"""The agent protocol: `agent(run, ctx) -> AgentResult`, run in the thread that executes the run;
`RunContext`, what the agent sees of its run; `LeasedCalls`, the calls made under its lease."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from psycopg_pool import ConnectionPool

from agent_runs.backoff import Backoff
from agent_runs.display import one_line
from agent_runs.errors import DB_ERRORS, LeaseLost
from agent_runs.fingerprint import manifest_fingerprint
from agent_runs.logs import logger
from agent_runs.models import AgentRun
from agent_runs.repository import AgentRunRepository
from agent_runs.worker import subagents
from agent_runs.worker.checkout import Repositories
from agent_runs.worker.heartbeat import HeartbeatService
from agent_runs.worker.lease import Lease
from agent_runs.worker.result import AgentResult

__all__ = ["Agent", "AgentResult", "LeasedCalls", "RunContext"]

log = logger("agent_runs.worker")

T = TypeVar("T")


class LeasedCalls:
    """Repository calls made for a run while its lease can be proven: database failures are
    retried with capped back-off until the lease can no longer be proven (LeaseLost)."""

    def __init__(self, repository: Repositories, *, retry_cap: float) -> None:
        self.repository = repository
        self._retry_cap = retry_cap

    def call(self, lease: Lease, call: Callable[[AgentRunRepository], T], what: str) -> T:
        """`call` with a pooled repository, retried while the lease holds."""
        backoff = Backoff(cap=self._retry_cap)
        while True:
            if not lease.provable():
                raise LeaseLost(f"run {lease.run_id}: lease owner {lease.worker_id} lost its lease")
            try:
                with self.repository() as repo:
                    return call(repo)
            except DB_ERRORS as exc:
                delay = backoff.next_delay()
                log.warning(
                    "run %s: could not %s (%s); retrying in %.1fs",
                    lease.run_id,
                    what,
                    one_line(exc, with_type=True),
                    delay,
                )
                time.sleep(delay)


class RunContext:
    """What an executing agent sees of its run: identity, stop requests, manifest recording."""

    def __init__(
        self,
        run: AgentRun,
        lease: Lease,
        attempt_no: int,
        stop: threading.Event | None,
        *,
        stopping: threading.Event,
        heartbeat: HeartbeatService,
        calls: LeasedCalls,
        pool: ConnectionPool,
    ) -> None:
        self._lease = lease
        self._stop = stop
        self._stopping = stopping  # the worker's: set once it shuts down
        self._heartbeat = heartbeat
        self._calls = calls
        self._pool = pool
        self.run_id = run.id
        self.run = run  # the run as this execution last wrote it (a recorded manifest included)
        self.attempt_no = attempt_no
        self.worker_id = lease.worker_id
        self.lease_seconds = lease.lease_seconds
        # Where a sub-agent call without a key happens, set by an agent adapter (a LangGraph
        # node: its task); None: the attempt itself. Calls are counted per scope.
        self.subagent_scope: Callable[[], str | None] | None = None
        self._subagent_calls: Counter[str | None] = Counter()
        self._subagent_lock = threading.Lock()

    def stop_reason(self) -> str | None:
        """Why the agent should stop (`cancel_requested`, `lease_lost`, `shutdown`), or None."""
        if self._lease.cancel_requested:
            return "cancel_requested"
        if self._lease.lost or self._lease.expired():
            return "lease_lost"
        if self._stopping.is_set() or (self._stop is not None and self._stop.is_set()):
            return "shutdown"
        return None

    def should_stop(self) -> bool:
        """True once the run is cancelled, its lease is lost, or the worker is shutting down."""
        return self.stop_reason() is not None

    def wait(self, seconds: float, *, tick: float = 0.05) -> bool:
        """Sleep up to `seconds`, waking early when the agent should stop; True if it should."""
        end = time.monotonic() + seconds
        while not self.should_stop():
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(tick, left))
        return True

    def stop_heartbeat(self) -> None:
        """Stop renewing this run's lease (it then expires); the worker no longer vouches for it."""
        self._heartbeat.stop_renewing(self._lease)

    def record_manifest(self, manifest: dict[str, Any]) -> bool:
        """Record the run's write-once manifest; False if one was already recorded.

        Raises NotLeaseOwner when the repository refuses (the run is not ours, or not running)
        and LeaseLost when the database stays unreachable until the lease can no longer be proven.
        """
        fingerprint = manifest_fingerprint(manifest)

        def write(repo: AgentRunRepository) -> bool:
            transition = repo.record_run_manifest(
                self.run_id, manifest=manifest, fingerprint=fingerprint, worker_id=self.worker_id
            )
            if transition.changed and transition.run is not None:
                self.run = transition.run
            return transition.changed

        return self._calls.call(self._lease, write, "record the manifest")

    @property
    def pool(self) -> ConnectionPool:
        """The worker's connection pool (its database: an agent's own tables may live there)."""
        return self._pool

    def record_resumed_from(self, checkpoint_id: str, step: int) -> bool:
        """Record, once, the checkpoint (and its step) this attempt resumed an earlier attempt's
        execution from; False if already recorded. Raises LeaseLost as record_manifest does."""

        def write(repo: AgentRunRepository) -> bool:
            return repo.record_resumed_from(
                self.run_id, worker_id=self.worker_id, checkpoint_id=checkpoint_id, step=step
            )

        return self._calls.call(self._lease, write, "record the resume point")

    def create_subagent_run(
        self,
        *,
        agent_slug: str,
        input_payload: Mapping[str, Any] | None = None,
        thread_id: str | None = None,
        request_id: str | None = None,
        key: str | None = None,
    ) -> AgentRun:
        """Create (or, for the same key, find again) a `subagent` run whose parent is this run.

        Unless given, `request_id` and `thread_id` derive from this run's id and `key` (default:
        the call's order in this attempt, within the scope an adapter set), so the next attempt
        of this run finds the child this one created (agent_runs.worker.subagents).
        """
        if key is None:
            scope = self.subagent_scope() if self.subagent_scope is not None else None
            with self._subagent_lock:
                self._subagent_calls[scope] += 1
                key = f"{scope or ''}#{self._subagent_calls[scope]}"
        derived = subagents.child_ids(self.run_id, subagents.checked_key(key))

        def create(repo: AgentRunRepository) -> AgentRun:
            return repo.create_run(
                thread_id=derived if thread_id is None else thread_id,
                agent_slug=agent_slug,
                uid=self.run.uid,
                request_id=derived if request_id is None else request_id,
                input_payload=input_payload,
                run_type="subagent",
                created_by_run_id=self.run_id,
            )

        return self._calls.call(self._lease, create, "create a sub-agent run")

    def wait_for_run(self, run_id: str, timeout_seconds: float) -> AgentRun:
        """The run (a child) once it is final; as it is as soon as this run should stop
        (cancel, lost lease, shutdown); TimeoutError after `timeout_seconds`. It blocks: a
        coroutine agent awaits it with `asyncio.to_thread`."""
        last: AgentRun | None = None

        def read() -> AgentRun | None:
            nonlocal last
            try:
                run = self._calls.call(
                    self._lease, lambda repo: repo.get_run(run_id), "read a sub-agent run"
                )
            except LeaseLost:
                try:
                    with self._calls.repository() as repo:
                        run = repo.get_run(run_id)
                except DB_ERRORS:
                    if last is None:
                        raise
                    run = last
            if run is not None:
                last = run
            return run

        return subagents.wait_for_child(run_id, read, self.should_stop, self.wait, timeout_seconds)


# A coroutine agent (`async def agent(run, ctx)`) runs on its worker thread's event loop
# (agent_runs.worker.coroutines).
Agent = Callable[[AgentRun, RunContext], AgentResult | Awaitable[AgentResult]]
