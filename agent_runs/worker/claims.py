"""The claim statements of one worker: each run claimed under an owner token of its own, its lease
tracked by the heartbeat before anything else (telemetry included) sees the claim, and the one
search for claims whose reply was lost.

Three statements claim: run_once's group of callers (`one`, one statement for the callers that
coincide), the claimer's free slots (`for_slots`), and the writer's ends with the next runs
(`with_ends`). Each has a lost-reply path, and all three take it through `recover`.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from datetime import datetime

from agent_runs import validation as check
from agent_runs.backoff import Backoff
from agent_runs.errors import DB_ERRORS
from agent_runs.logs import logger
from agent_runs.models import AgentRun, ClaimedRun, Finish
from agent_runs.repository import AgentRunRepository
from agent_runs.telemetry.sdk_guard import deferred
from agent_runs.worker.batching import GroupCommit
from agent_runs.worker.checkout import Repositories
from agent_runs.worker.heartbeat import HeartbeatService
from agent_runs.worker.lease import Claimed, Lease

log = logger("agent_runs.worker")


class ClaimNotSent(Exception):
    """No connection for a claim statement: nothing was sent, so nothing can be in doubt."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


class Claiming:
    """The claim statements for runs of `agent_slugs` (module docstring)."""

    def __init__(
        self,
        repository: Repositories,
        heartbeat: HeartbeatService,
        *,
        name: str,
        lease_seconds: float,
        retry_cap: float,
        agent_slugs: list[str] | None,
        stopping: threading.Event,
    ) -> None:
        self._repository = repository
        self._heartbeat = heartbeat
        self._name = name
        self._lease_seconds = lease_seconds
        self._retry_cap = retry_cap
        self._agent_slugs = agent_slugs
        self._stopping = stopping  # set: claim nothing more
        # run_once callers that claim at the same time share one claim statement.
        self.group: GroupCommit[str, Claimed | None] = GroupCommit(
            self._batch, max_batch=check.MAX_BATCH
        )

    def token(self) -> str:
        """A fresh owner token per claim: a restarted worker never inherits an old lease."""
        return f"{self._name}:{uuid.uuid4().hex}"

    def one(self) -> Claimed | None:
        """run_once's claim, in one statement with the other callers claiming now.

        Raises database errors of the claim itself when nothing can have been claimed."""
        token = self.token()
        # Taken before the claim is sent: the lease cannot start earlier in the database.
        claimed_at = time.monotonic()
        try:
            claimed = self.group.submit(token)
        except ClaimNotSent as exc:  # no connection: nothing was claimed
            raise exc.error from None
        except DB_ERRORS:
            found = self.recover([token], claimed_at)
            if not found:
                raise
            return found[0]
        return claimed

    def for_slots(self, count: int) -> list[Claimed]:
        """Up to `count` runs in one statement, for the claimer's free slots.

        Raises database errors of the claim itself when nothing can have been claimed."""
        tokens = [self.token() for _ in range(count)]
        claimed_at = time.monotonic()
        try:
            answers = self._batch(tokens)
        except ClaimNotSent as exc:
            raise exc.error from None
        except DB_ERRORS:
            found = self.recover(tokens, claimed_at)
            if not found:
                raise
            return found
        return [claimed for claimed in answers if claimed is not None]

    def with_ends(
        self, finishes: list[Finish], count: int
    ) -> tuple[list[datetime | None] | None, list[Claimed]]:
        """finish_runs for `finishes` and a claim of up to `count` runs in one statement: each
        end's finished_at (None where refused), and the runs claimed.

        After a lost reply the ends are unknown (None: the caller confirms them one by one) and
        the claims are found by `recover`. Raises the error when no connection could be had
        (nothing was sent)."""
        tokens = [self.token() for _ in range(count)]
        claimed_at = time.monotonic()
        with deferred():  # the ends' and the claims' telemetry once the claims are tracked
            try:
                with self._checked_out() as repo:
                    sent_at = time.monotonic()
                    finished, claimed = repo.finish_runs_and_claim(
                        finishes,
                        worker_ids=tokens,
                        lease_seconds=self._lease_seconds,
                        agent_slugs=self._agent_slugs,
                    )
            except ClaimNotSent as exc:
                raise exc.error from None
            except DB_ERRORS:
                return None, self.recover(tokens, claimed_at)
            return [finished.get(finish.run_id) for finish in finishes], self._tracked(
                tokens, claimed, sent_at
            )

    def recover(self, tokens: Sequence[str], claimed_at: float) -> list[Claimed]:
        """The claims of `tokens` that committed although their statement's reply was lost,
        each tracked by the heartbeat; [] when none did.

        The rule: every token is looked up (`get_run_by_owner`), and every run found is kept.
        A statement hands its tokens to its runs in claim order, but a run over its key's limit
        is dropped after that numbering, so the token after a gap may still hold a run: stopping
        at the first token without one would leave that run to expire unexecuted. Database
        failures are retried while the leases can still be live (`claimed_at`, taken before
        the statement was sent, plus the lease); what was found by then is kept."""
        deadline = claimed_at + self._lease_seconds
        backoff = Backoff(cap=self._retry_cap)
        found: list[Claimed] = []
        left = list(tokens)
        while left and time.monotonic() < deadline:
            try:
                # their telemetry once they are tracked
                with deferred(), self._repository() as repo:
                    while left:
                        run = repo.get_run_by_owner(left[0])
                        token = left.pop(0)
                        if run is not None:
                            lease = self._track(run, token, claimed_at)
                            found.append(Claimed(run, lease, None))
            except DB_ERRORS:
                time.sleep(min(backoff.next_delay(), max(0.0, deadline - time.monotonic())))
        for claimed in found:
            log.warning("run %s: claim reply was lost; found it by its owner token", claimed.run.id)
        return found

    def next_available_in(self) -> float | None:
        """Seconds until a run of ours scheduled for later becomes claimable (None: none)."""
        with self._repository() as repo:
            return repo.next_available_in(agent_slugs=self._agent_slugs)

    def _batch(self, tokens: list[str]) -> list[Claimed | None]:
        """One claim statement for `tokens`: a run each, oldest first, its lease counted from
        the moment the statement was sent (after the checkout, which may wait out an outage: no
        lease of the batch starts earlier in the database)."""
        if self._stopping.is_set():  # a stop request arrived while these claimers waited
            return [None] * len(tokens)
        with deferred():  # the claims' telemetry once they are tracked
            with self._checked_out() as repo:
                sent_at = time.monotonic()
                if len(tokens) == 1:  # a lone claimer: claim_next's own statement (LIMIT 1)
                    one = repo.claim_next_attempt(
                        worker_id=tokens[0],
                        lease_seconds=self._lease_seconds,
                        agent_slugs=self._agent_slugs,
                    )
                    claimed = [] if one is None else [one]
                else:
                    claimed = repo.claim_next_attempts(
                        worker_ids=tokens,
                        lease_seconds=self._lease_seconds,
                        agent_slugs=self._agent_slugs,
                    )
            by_owner = {c.lease.worker_id: c for c in self._tracked(tokens, claimed, sent_at)}
        return [by_owner.get(token) for token in tokens]

    def _tracked(
        self, tokens: Sequence[str], claimed: list[ClaimedRun], sent_at: float
    ) -> list[Claimed]:
        """The claimed runs in token order, each lease tracked."""
        by_owner = {c.run.worker_id: c for c in claimed}
        return [
            Claimed(one.run, self._track(one.run, token, sent_at), one.attempt_no)
            for token in tokens
            if (one := by_owner.get(token)) is not None
        ]

    def _track(self, run: AgentRun, token: str, sent_at: float) -> Lease:
        return self._heartbeat.track(run.id, token, deadline=sent_at + self._lease_seconds)

    @contextmanager
    def _checked_out(self) -> Iterator[AgentRunRepository]:
        """A repository for one claim statement; ClaimNotSent when no connection could be had
        (nothing was sent)."""
        with ExitStack() as checkout:
            try:
                repo = checkout.enter_context(self._repository())
            except DB_ERRORS as exc:
                raise ClaimNotSent(exc) from exc
            yield repo
