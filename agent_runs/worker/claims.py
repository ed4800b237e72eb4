"""The claim statements: run_once's group of claimers and the claimer's free slots, each run under
its own lease, and the search for a claim whose reply was lost (by its owner token).

What they need of the worker arrives as `ClaimingFor`; the runtime never lends itself out.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import datetime
from typing import Protocol

from agent_runs.backoff import Backoff
from agent_runs.errors import DB_ERRORS
from agent_runs.logs import logger
from agent_runs.models import AgentRun, ClaimedRun, Finish
from agent_runs.repository import AgentRunRepository
from agent_runs.telemetry.sdk_guard import deferred
from agent_runs.worker.claimer import Claimed
from agent_runs.worker.heartbeat import HeartbeatService, Lease

log = logger("agent_runs.worker")


class ClaimingFor(Protocol):
    """What claiming needs of the worker it claims for (agent_runs.worker.Worker)."""

    lease_seconds: float
    heartbeat_seconds: float
    agent_slugs: list[str] | None
    heartbeat: HeartbeatService

    @property
    def stopping(self) -> bool: ...

    def repository(self) -> AbstractContextManager[AgentRunRepository]: ...

    def new_owner_token(self) -> str: ...


class ClaimNotSent(Exception):
    """No connection for a batch of claims: nothing was sent, so nothing can be in doubt."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def claim_for_slots(worker: ClaimingFor, count: int) -> list[Claimed]:
    """Claim up to `count` runs in one statement for the claimer, each under its own lease.

    Raises database errors of the claim itself when nothing can have been claimed; after a
    lost reply, the runs are found by their owner tokens (as run_once does)."""
    tokens = [worker.new_owner_token() for _ in range(count)]
    claimed_at = time.monotonic()  # as in run_once: no lease starts earlier in the database
    try:
        answers = claim_batch(worker, tokens)
    except ClaimNotSent as exc:
        raise exc.error from None
    except DB_ERRORS:
        found = [
            (token, run)
            for token in tokens
            if (run := find_claim_in_doubt(worker, token, claimed_at)) is not None
        ]
        if not found:
            raise
        return [Claimed(run, track(worker, run, token, claimed_at), None) for token, run in found]
    return [
        Claimed(one.run, track(worker, one.run, token, sent_at), one.attempt_no)
        for token, (one, sent_at) in zip(tokens, answers, strict=True)
        if one is not None
    ]


def finish_and_claim(
    worker: ClaimingFor, finishes: list[Finish], count: int
) -> tuple[list[datetime | None] | None, list[Claimed]]:
    """finish_runs for `finishes` and a claim of up to `count` runs (no more than it finished)
    in one statement: each end's finished_at (None where refused), and the runs claimed.

    After a lost reply the ends are unknown (None: the caller confirms them one by one) and the
    claims are found by their owner tokens; raises ClaimNotSent when nothing was sent."""
    tokens = [worker.new_owner_token() for _ in range(count)]
    claimed_at = time.monotonic()
    with deferred():  # the ends' and the claims' telemetry once the claims are tracked
        try:
            finished, claimed, sent_at = _finish_and_claim(worker, finishes, tokens)
        except DB_ERRORS:
            found: list[Claimed] = []
            for token in tokens:  # the n-th claim went to the n-th token: the first gap ends it
                run = find_claim_in_doubt(worker, token, claimed_at)
                if run is None:
                    break
                found.append(Claimed(run, track(worker, run, token, claimed_at), None))
            return None, found
        return [finished.get(finish.run_id) for finish in finishes], [
            Claimed(one.run, track(worker, one.run, token, sent_at), one.attempt_no)
            for token, one in _by_token(tokens, claimed)
        ]


def _finish_and_claim(
    worker: ClaimingFor, finishes: list[Finish], tokens: list[str]
) -> tuple[dict[str, datetime], list[ClaimedRun], float]:
    with checked_out(worker) as repo:
        sent_at = time.monotonic()
        finished, claimed = repo.finish_runs_and_claim(
            finishes,
            worker_ids=tokens,
            lease_seconds=worker.lease_seconds,
            agent_slugs=worker.agent_slugs,
        )
    return finished, claimed, sent_at


@contextmanager
def checked_out(worker: ClaimingFor) -> Iterator[AgentRunRepository]:
    """The worker's repository for one claim statement; ClaimNotSent when no connection could
    be had (nothing was sent)."""
    with ExitStack() as checkout:
        try:
            repo = checkout.enter_context(worker.repository())
        except DB_ERRORS as exc:
            raise ClaimNotSent(exc) from exc
        yield repo


def _by_token(tokens: Sequence[str], claimed: list[ClaimedRun]) -> list[tuple[str, ClaimedRun]]:
    by_owner = {c.run.worker_id: c for c in claimed}
    return [(token, by_owner[token]) for token in tokens if token in by_owner]


def track(worker: ClaimingFor, run: AgentRun, token: str, sent_at: float) -> Lease:
    return worker.heartbeat.track(run.id, token, deadline=sent_at + worker.lease_seconds)


def claim_batch(worker: ClaimingFor, tokens: list[str]) -> list[tuple[ClaimedRun | None, float]]:
    """One claim statement for every claimer thread waiting now: a run each, oldest first,
    with the moment the statement was sent (after the checkout, which may wait out an
    outage: no lease of the batch starts earlier in the database)."""
    if worker.stopping:  # a stop request arrived while these claimers waited: claim nothing
        return [(None, time.monotonic())] * len(tokens)
    with deferred():  # the claims' telemetry once they are tracked (the callers' track: same)
        with checked_out(worker) as repo:
            sent_at = time.monotonic()
            if len(tokens) == 1:  # a lone claimer: claim_next's own statement (LIMIT 1)
                one = repo.claim_next_attempt(
                    worker_id=tokens[0],
                    lease_seconds=worker.lease_seconds,
                    agent_slugs=worker.agent_slugs,
                )
                claimed = [] if one is None else [one]
            else:
                claimed = repo.claim_next_attempts(
                    worker_ids=tokens,
                    lease_seconds=worker.lease_seconds,
                    agent_slugs=worker.agent_slugs,
                )
        by_owner = {c.run.worker_id: c for c in claimed}
        for token in tokens:
            if (found := by_owner.get(token)) is not None:
                track(worker, found.run, token, sent_at)
    return [(by_owner.get(token), sent_at) for token in tokens]


def find_claim_in_doubt(worker: ClaimingFor, token: str, claimed_at: float) -> AgentRun | None:
    """A claim whose reply was lost may have committed: find it by its owner token while
    its lease can still be live, rather than leave it to expire unexecuted."""
    deadline = claimed_at + worker.lease_seconds
    backoff = Backoff(cap=max(0.2, worker.heartbeat_seconds))
    while time.monotonic() < deadline:
        try:
            with deferred():  # its telemetry once it is tracked (the caller's track: the same)
                with worker.repository() as repo:
                    run = repo.get_run_by_owner(token)
                if run is not None:
                    track(worker, run, token, claimed_at)
        except DB_ERRORS:
            time.sleep(min(backoff.next_delay(), max(0.0, deadline - time.monotonic())))
            continue
        if run is not None:
            log.warning("run %s: claim reply was lost; found it by its owner token", run.id)
        return run
    return None
