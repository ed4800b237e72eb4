"""One claimed run's execution: the cancel checks, the agent call, the decision, the end handed.

The executor runs a run it is given under a lease it is given; it never claims (runtime.py,
claims.py) and never writes itself (completer.py writes now, flusher.py later). What it needs
of the worker arrives as `ExecutingWorker`.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from agent_runs.errors import LeaseLost
from agent_runs.logs import logger
from agent_runs.models import AgentRun, RunStatus
from agent_runs.repository import AgentRunRepository
from agent_runs.worker.completer import Completer, run_as_written
from agent_runs.worker.coroutines import await_agent
from agent_runs.worker.heartbeat import Lease
from agent_runs.worker.outcome import CANCELLED, RELEASE, Decision, Ending, decide
from agent_runs.worker.protocol import Agent, Executor, RunContext

if TYPE_CHECKING:
    from agent_runs.worker.flusher import Flusher

log = logger("agent_runs.worker")


class ExecutingWorker(Executor, Protocol):
    """What executing a run needs of the worker (agent_runs.worker.Worker)."""

    agent: Agent
    max_tries: int
    completion: str
    exit_code: int
    completer: Completer
    flusher: Flusher

    def request_stop(self) -> None: ...


def execute(
    worker: ExecutingWorker,
    run: AgentRun,
    lease: Lease,
    stop: threading.Event | None,
    attempt_no: int | None,
    *,
    hand_over: bool,
) -> AgentRun:
    """Execute the agent and have the end written: here, or (`hand_over`) by the writer."""
    tag = f"run {run.id} ({lease.worker_id})"
    if attempt_no is None:  # a claim found after its reply was lost: read our attempt
        try:
            attempt_no = worker.with_lease_retry(lease, _own_attempt_no(run.id, lease), "read")
        except LeaseLost:
            log.warning("%s: lease lost before the agent started; writing nothing", tag)
            return worker.completer.reread(run)
    if attempt_no is None:
        lease.lost = True
        log.warning("%s: no open attempt of ours after the claim; writing nothing", tag)
        return worker.completer.reread(run)
    tag = f"run {run.id} attempt {attempt_no} ({lease.worker_id})"

    if run.status == RunStatus.CANCEL_REQUESTED:
        log.info("%s: claimed with a cancel request; finishing cancelled", tag)
        return worker.completer.finish(run, lease, CANCELLED, tag)

    ctx = RunContext(worker, run, lease, attempt_no, stop)
    # What happened between the claim and the start (a claimed run may wait for a thread).
    before_start = ctx.stop_reason()
    if before_start == "cancel_requested":
        log.info("%s: cancel requested before the agent started; finishing cancelled", tag)
        return worker.completer.finish(run, lease, CANCELLED, tag)
    if before_start == "lease_lost":
        log.warning("%s: lease lost before the agent started; writing nothing", tag)
        return worker.completer.reread(run)
    if before_start == "shutdown":
        log.info("%s: shutting down before the agent started; releasing", tag)
        return worker.completer.finish(run, lease, RELEASE, tag)
    log.debug("%s: started (agent slug %s)", tag, run.agent_slug)
    ending = _call(worker.agent, run, ctx)
    if ending.stops_worker:
        worker.exit_code = 1
        worker.request_stop()
        log.error("%s: the agent raised %s; the worker stops", tag, type(ending.raised).__name__)

    if lease.lost:
        log.warning("%s: lease lost during execution; writing nothing", tag)
        ended = worker.completer.reread(run)
    elif lease.expired() and not lease.heartbeat_stopped:
        log.warning("%s: lease could not be proven until its expiry; dropping the run", tag)
        ended = worker.completer.reread(run)
    else:
        decision = decide(
            ending,
            stop_reason=ctx.stop_reason(),
            attempt_no=attempt_no,
            max_tries=worker.max_tries,
        )
        # An agent that stops the process has its end written before the exception goes on
        # (with async completion only once the writer closes).
        hand_over = hand_over and (worker.completion == "async" or not ending.stops_worker)
        ended = finish(worker, ctx.run, lease, decision, tag, hand_over=hand_over)
    if isinstance(ending.raised, KeyboardInterrupt):
        raise ending.raised
    return ended


def finish(
    worker: ExecutingWorker,
    run: AgentRun,
    lease: Lease,
    decision: Decision,
    tag: str,
    *,
    hand_over: bool,
) -> AgentRun:
    """Write the end now, or (`hand_over`) hand it to the writer thread and return the run
    as it will be written, finished_at not yet known."""
    flusher = worker.flusher
    if (
        not hand_over
        or decision.releases
        or decision.retry_error is not None
        or not lease.provable()
        or lease.heartbeat_stopped
        or not flusher.hand(run, lease, decision, tag)
    ):
        return worker.completer.finish(run, lease, decision, tag)
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
