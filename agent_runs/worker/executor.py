"""One claimed run's execution: the cancel checks, the agent call, the decision, the end handed.

The executor runs a run it is given under a lease it is given; it never claims (claims.py,
claimer.py) and never writes itself (completer.py writes now; `hand`, the writer thread's
intake, takes an end to write later).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from psycopg_pool import ConnectionPool

from agent_runs.errors import LeaseLost
from agent_runs.logs import logger
from agent_runs.models import AgentRun, RunStatus
from agent_runs.repository import AgentRunRepository
from agent_runs.worker.completer import Completer
from agent_runs.worker.coroutines import await_agent
from agent_runs.worker.heartbeat import HeartbeatService
from agent_runs.worker.lease import Claimed, Lease
from agent_runs.worker.outcome import CANCELLED, RELEASE, Decision, Ending, decide, run_as_written
from agent_runs.worker.protocol import Agent, LeasedCalls, RunContext

if TYPE_CHECKING:  # telemetry off never imports it
    from agent_runs.telemetry import Telemetry

log = logger("agent_runs.worker")

# The writer thread's intake: takes a terminal decision to write later; False when it is closed.
Hand = Callable[[AgentRun, Lease, Decision, str], bool]


class Executor:
    """Executes claimed runs with `agent` (module docstring)."""

    def __init__(
        self,
        agent: Agent,
        *,
        completer: Completer,
        heartbeat: HeartbeatService,
        calls: LeasedCalls,
        hand: Hand,
        pool: ConnectionPool,
        stopping: threading.Event,
        on_agent_exit: Callable[[], None],
        max_tries: int,
        async_completion: bool,
        telemetry: Telemetry | None = None,
    ) -> None:
        """`hand` takes ends to write later; `stopping` is set once the worker shuts down;
        `on_agent_exit()` is called when an agent asks the process to stop."""
        self._agent = agent
        self._completer = completer
        self._heartbeat = heartbeat
        self._calls = calls
        self._hand = hand
        self._pool = pool
        self._stopping = stopping
        self._on_agent_exit = on_agent_exit
        self._max_tries = max_tries
        self._async_completion = async_completion
        self._telemetry = telemetry
        # 0 while all is well; 1 once an agent asked the process to exit.
        self.exit_code = 0

    def run(self, claimed: Claimed, stop: threading.Event | None, *, hand_over: bool) -> AgentRun:
        """Execute `claimed` under its attempt's telemetry span; its lease is untracked
        afterwards unless its end was handed over (the writer untracks it once written)."""
        lease = claimed.lease
        try:
            if self._telemetry is None:
                return self.execute(claimed, stop, hand_over=hand_over)
            # the attempt's span, started where the run was claimed, is current here
            with self._telemetry.executing(lease.worker_id):
                return self.execute(claimed, stop, hand_over=hand_over)
        finally:
            if not lease.written_later:
                self._heartbeat.untrack(lease)

    def execute(
        self, claimed: Claimed, stop: threading.Event | None, *, hand_over: bool
    ) -> AgentRun:
        """Execute the agent and have the end written: here, or (`hand_over`) by the writer."""
        run, lease, attempt_no = claimed.run, claimed.lease, claimed.attempt_no
        completer = self._completer
        tag = f"run {run.id} ({lease.worker_id})"
        if attempt_no is None:  # a claim found after its reply was lost: read our attempt
            try:
                attempt_no = self._calls.call(lease, _own_attempt_no(run.id, lease), "read")
            except LeaseLost:
                log.warning("%s: lease lost before the agent started; writing nothing", tag)
                return completer.reread(run)
        if attempt_no is None:
            lease.lost = True
            log.warning("%s: no open attempt of ours after the claim; writing nothing", tag)
            return completer.reread(run)
        tag = f"run {run.id} attempt {attempt_no} ({lease.worker_id})"

        if run.status == RunStatus.CANCEL_REQUESTED:
            log.info("%s: claimed with a cancel request; finishing cancelled", tag)
            return completer.finish(run, lease, CANCELLED, tag)

        ctx = RunContext(
            run,
            lease,
            attempt_no,
            stop,
            stopping=self._stopping,
            heartbeat=self._heartbeat,
            calls=self._calls,
            pool=self._pool,
        )
        # What happened between the claim and the start (a claimed run may wait for a thread).
        before_start = ctx.stop_reason()
        if before_start == "cancel_requested":
            log.info("%s: cancel requested before the agent started; finishing cancelled", tag)
            return completer.finish(run, lease, CANCELLED, tag)
        if before_start == "lease_lost":
            log.warning("%s: lease lost before the agent started; writing nothing", tag)
            return completer.reread(run)
        if before_start == "shutdown":
            log.info("%s: shutting down before the agent started; releasing", tag)
            return completer.finish(run, lease, RELEASE, tag)
        log.debug("%s: started (agent slug %s)", tag, run.agent_slug)
        ending = _call(self._agent, run, ctx)
        if ending.stops_worker:
            self.exit_code = 1
            self._on_agent_exit()
            log.error(
                "%s: the agent raised %s; the worker stops", tag, type(ending.raised).__name__
            )

        if lease.lost:
            log.warning("%s: lease lost during execution; writing nothing", tag)
            ended = completer.reread(run)
        elif lease.expired() and not lease.heartbeat_stopped:
            log.warning("%s: lease could not be proven until its expiry; dropping the run", tag)
            ended = completer.reread(run)
        else:
            decision = decide(
                ending,
                stop_reason=ctx.stop_reason(),
                attempt_no=attempt_no,
                max_tries=self._max_tries,
            )
            # An agent that stops the process has its end written before the exception goes on
            # (with async completion only once the writer closes).
            hand_over = hand_over and (self._async_completion or not ending.stops_worker)
            ended = self._finish(ctx.run, lease, decision, tag, hand_over=hand_over)
        if isinstance(ending.raised, KeyboardInterrupt):
            raise ending.raised
        return ended

    def _finish(
        self, run: AgentRun, lease: Lease, decision: Decision, tag: str, *, hand_over: bool
    ) -> AgentRun:
        """Write the end now, or (`hand_over`) hand it to the writer thread and return the run
        as it will be written, finished_at not yet known."""
        if (
            not hand_over
            or decision.releases
            or decision.retry_error is not None
            or not lease.provable()
            or lease.heartbeat_stopped
            or not self._hand(run, lease, decision, tag)
        ):
            return self._completer.finish(run, lease, decision, tag)
        log.debug("%s: %s, handed to the flusher", tag, decision.status)
        return run_as_written(run, decision, None)


def _call(agent: Agent, run: AgentRun, ctx: RunContext) -> Ending:
    """Run the agent (a coroutine agent on this thread's event loop); whatever it returns or
    raises becomes an Ending (nothing escapes)."""
    try:
        returned: object = agent(run, ctx)
        if inspect.isawaitable(returned):
            returned = await_agent(returned, ctx.should_stop)
        return Ending(returned=returned)
    except BaseException as exc:  # every way an agent can end is a fact to record
        return Ending(raised=exc)


def _own_attempt_no(run_id: str, lease: Lease) -> Callable[[AgentRunRepository], int | None]:
    def read(repo: AgentRunRepository) -> int | None:
        attempt = repo.get_open_attempt(run_id)
        if attempt is None or attempt.worker_id != lease.worker_id:
            return None
        return attempt.attempt_no

    return read
