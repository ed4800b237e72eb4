"""Wake-ups over LISTEN/NOTIFY: workers wake when a run becomes claimable, callers wait for a
run's end.

The transitions send them inside their own statement (sql/), so a notification is delivered at
commit, never before the change is visible, and a rolled-back change sends nothing:

- `agent_runs_claimable`, payload the run's agent_slug: create_run (a real insert),
  release_lease_for_retry, and a request_cancel that leaves an ownerless cancel_requested run.
- `agent_runs_finished`, payload the run id: the terminal transition of a run that a waiter
  registered interest in (wait_for_run; see agent_runs.waiters). A run nobody waits for ends
  without NOTIFY: notifying transactions serialize their commits.

LISTEN needs a session of its own on the server: through a transaction-mode pooler it is not
reliable, so give the listener a direct connection, or rely on the poll fallbacks.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from contextlib import closing
from typing import Any, Final, LiteralString

import psycopg
from psycopg import pq
from psycopg.rows import tuple_row

from agent_runs import waiters
from agent_runs.backoff import Backoff
from agent_runs.errors import InvalidArgument
from agent_runs.logs import logger
from agent_runs.models import AgentRun
from agent_runs.repository import AgentRunRepository
from agent_runs.steps import Failed, next_step
from agent_runs.turns import turns
from agent_runs.waiters import (
    FINISHED_CHANNEL,
    FLOOD_NOTIFICATIONS,
    FLOODED_POLL_SECONDS,
    WAIT_POLL_SECONDS,
)

__all__ = [
    "CLAIMABLE_CHANNEL",
    "FINISHED_CHANNEL",
    "FLOODED_POLL_SECONDS",
    "FLOOD_NOTIFICATIONS",
    "MAX_PENDING",
    "WAIT_POLL_SECONDS",
    "Wakeups",
    "wait_for_run",
]

CLAIMABLE_CHANNEL: Final = "agent_runs_claimable"

_LISTEN_CLAIMABLE: Final = "LISTEN agent_runs_claimable"
_NOTIFY_PROBE: Final = "SELECT pg_notify(%s, %s)"
# A listener's probe payload: longer than any agent slug, so no listener takes it for a wake-up.
_PROBE_PREFIX: Final = "agent_runs listener probe, not an agent slug: "
_PROBE_SECONDS: Final = 2.0
_MAX_SLUG_LENGTH: Final = 64

# Wakeups: pending wake-ups kept while no claimer waits (a burst never queues more).
MAX_PENDING: Final = 10_000
# The listener thread checks its stop flag at least this often.
_LISTEN_SLICE_SECONDS: Final = 0.25
_LISTENER_DEFAULTS: Final[Mapping[str, Any]] = {"connect_timeout": 5, **waiters.KEEPALIVES}

log = logger("agent_runs.notify")


def wait_for_run(conn: psycopg.Connection[Any], run_id: str, *, timeout_seconds: float) -> AgentRun:
    """Block until run `run_id` is terminal and return it.

    Raises InvalidArgument for bad arguments or an unknown run, TimeoutError when the run is not
    terminal after `timeout_seconds`. `conn` must be an autocommit connection outside a
    transaction, of any row factory; it registers the wait, reads the run and unregisters, and
    is left idle afterwards. Its statements take turns with repository calls from other
    threads sharing `conn`, never running inside their transaction(). While the run is not
    terminal the wait LISTENs on agent_runs_finished on a connection of its own, opened as
    `conn` was and closed when the wait returns (agent_runs.waiters says why).
    """
    return _SyncWait(conn).drive(
        waiters.wait_plan(run_id, timeout_seconds, poll_seconds=WAIT_POLL_SECONDS)
    )


class _SyncWait:
    """Carries out a wait's steps (agent_runs.waiters) on `conn` and a listener of its own."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn
        self.listener: psycopg.Connection[Any] | None = None

    def drive(self, plan: waiters.WaitPlan) -> AgentRun:
        answer: object = None
        while True:
            try:
                step = next_step(plan, answer)
            except StopIteration as stop:
                run: AgentRun = stop.value
                return run
            try:
                answer = self.carry_out(step)
            except BaseException as exc:  # thrown into the plan, which cleans up and re-raises
                answer = Failed(exc)

    def carry_out(self, step: waiters.WaitStep) -> object:
        match step:
            case waiters.Register():
                return self.register(step)
            case waiters.Listen():
                return self.listen()
            case waiters.Read(run_id=run_id):
                return AgentRunRepository(self.conn).get_run(run_id)
            case waiters.Hear():
                return self.hear(step)
            case waiters.Sleep(until=until):
                time.sleep(max(0.0, until - time.monotonic()))
            case waiters.StopListening():
                self.stop_listening()
            case waiters.Unregister(run_id=run_id, waiter_id=waiter_id):
                with turns(self.conn):
                    if self.idle():
                        waiters.unregister(self.conn, run_id, waiter_id)
        return None

    def idle(self) -> bool:
        conn = self.conn
        return (
            not conn.closed
            and not conn.broken
            and conn.info.transaction_status == pq.TransactionStatus.IDLE
        )

    def register(self, step: waiters.Register) -> bool:
        if not self.conn.autocommit:
            raise InvalidArgument(waiters.NOT_IDLE)
        turn = turns(self.conn)
        if not turn.acquire(timeout=step.timeout):
            raise TimeoutError(
                f"run {step.run_id!r}: the connection stayed busy with other calls for"
                f" {step.timeout:g} seconds"
            )
        try:
            if not self.idle():
                raise InvalidArgument(waiters.NOT_IDLE)
            return waiters.register(self.conn, step.run_id, step.waiter_id, step.timeout)
        finally:
            turn.release()

    def listen(self) -> bool:
        try:
            self.listener = psycopg.connect(
                waiters.listener_conninfo(self.conn.info), **waiters.LISTENER_OPTIONS
            )
            _execute(self.listener, waiters.LISTEN)
        except psycopg.Error as exc:
            log.debug("wait_for_run polls: its listener did not connect (%s)", type(exc).__name__)
            self.stop_listening()
            return False
        return True

    def hear(self, step: waiters.Hear) -> str:
        assert self.listener is not None
        hearing = waiters.Hearing(step)
        try:
            with closing(self.listener.notifies(timeout=hearing.remaining())) as received:
                for notify in received:
                    if verdict := hearing.verdict(notify.channel, notify.payload):
                        return verdict
        except psycopg.Error as exc:
            log.debug("wait_for_run polls: its listener failed (%s)", type(exc).__name__)
            return waiters.LOST
        return waiters.QUIET

    def stop_listening(self) -> None:
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.close()


def _execute(conn: psycopg.Connection[Any], statement: LiteralString) -> None:
    """A statement without parameters, never through the connection's own row factory."""
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(statement, prepare=False)


class Wakeups:
    """One LISTEN connection per worker process, handing each wake-up to one idle claimer.

    A daemon thread listens on agent_runs_claimable. Each notification for a served agent slug
    (any slug when `agent_slugs` is None) becomes one token: it releases exactly one claimer
    blocked in `wait`, or, when none waits, is kept (up to `max_pending`) for the next `wait`,
    so a wake-up arriving between a claimer's empty claim and its next wait is not lost. A
    burst of N notifications wakes at most N claimers. After every (re)connect one catch-up
    token is posted: a run may have become claimable while nobody listened.
    """

    def __init__(
        self,
        conninfo: str,
        *,
        agent_slugs: Sequence[str] | None = None,
        connect_kwargs: Mapping[str, Any] | None = None,
        max_pending: int = MAX_PENDING,
    ) -> None:
        if isinstance(agent_slugs, str):
            raise InvalidArgument("agent_slugs must be a list of slugs, not a string")
        if max_pending < 1:
            raise InvalidArgument(f"max_pending must be >= 1, not {max_pending!r}")
        self._conninfo = conninfo
        self._slugs = None if agent_slugs is None else frozenset(agent_slugs)
        self._connect_kwargs = {**_LISTENER_DEFAULTS, **(connect_kwargs or {}), "autocommit": True}
        self._max_pending = max_pending
        self._cond = threading.Condition()
        self._tokens = 0
        self._interrupted = False
        self._stop = threading.Event()
        self._listening = False
        # Set when a probe showed that notifications never reach the listener: it gave up.
        self.deaf = False
        self._thread: threading.Thread | None = None

    @property
    def listening(self) -> bool:
        """True while LISTEN is in force on a live connection."""
        return self._listening

    def start(self) -> None:
        """Start the listener thread (once)."""
        if self._thread is not None:
            raise RuntimeError("Wakeups already started")
        thread = threading.Thread(target=self._listen, name="agent-runs-wakeups", daemon=True)
        thread.start()  # kept only once started: close() never joins a thread that is not
        self._thread = thread

    def wait(self, timeout: float) -> bool:
        """Block until a wake-up is taken (True), the timeout passes or interrupt() (False)."""
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            while not self._tokens and not self._interrupted:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            if self._interrupted:
                return False
            self._tokens -= 1
            return True

    def limit_pending(self, limit: int) -> None:
        """Keep at most `limit` wake-ups for claimers to come (e.g. the number of claimer
        threads: after a burst each idle thread needs one, more would be empty claims)."""
        with self._cond:
            self._max_pending = max(1, limit)
            self._tokens = min(self._tokens, self._max_pending)

    def interrupt(self) -> None:
        """Wake every waiter now; every later wait returns False at once."""
        with self._cond:
            self._interrupted = True
            self._cond.notify_all()

    def close(self) -> None:
        """Interrupt the waiters, stop the listener thread (it closes its connection), join it."""
        self.interrupt()
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    # -- the listener thread ---------------------------------------------------------------

    def _post(self) -> None:
        with self._cond:
            if self._tokens < self._max_pending:
                self._tokens += 1
                self._cond.notify()

    def _accepts(self, payload: str) -> bool:
        # An agent slug has 1-64 characters: anything else (a listener's probe) is no wake-up.
        if not 0 < len(payload) <= _MAX_SLUG_LENGTH:
            return False
        return self._slugs is None or payload in self._slugs

    def _listen(self) -> None:
        backoff = Backoff(initial=0.1, cap=10.0)  # between failed connects since the last drop
        dropped = False
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._conninfo, **self._connect_kwargs) as conn:
                    _execute(conn, _LISTEN_CLAIMABLE)
                    if not self._probe(conn):
                        log.warning(
                            "wake-ups do not reach the %s listener (a transaction pooler "
                            "between it and PostgreSQL?): claimers poll instead; give the "
                            "worker a direct connection for wake-ups (--listen-dsn)",
                            CLAIMABLE_CHANNEL,
                        )
                        self.deaf = True
                        return
                    self._listening = True
                    if dropped:
                        log.info("listening on %s again", CLAIMABLE_CHANNEL)
                    backoff.reset()
                    dropped = False
                    self._post()  # catch up on whatever became claimable while nobody listened
                    self._receive(conn)
                    self._listening = False
            except psycopg.Error as exc:
                self._listening = False
                if self._stop.is_set():
                    break
                if not dropped:
                    log.warning(
                        "the %s listener is down (%s); reconnecting with back-off, claimers "
                        "poll meanwhile",
                        CLAIMABLE_CHANNEL,
                        " ".join(str(exc).split()) or type(exc).__name__,
                    )
                    dropped = True
                else:
                    log.debug("listener reconnect failed: %s", type(exc).__name__)
                self._stop.wait(backoff.next_delay())
        self._listening = False

    def _probe(self, conn: psycopg.Connection[Any]) -> bool:
        """Whether a notification sent by another session reaches this listening one. Through
        a transaction-mode pooler it does not: LISTEN held for one transaction on a server
        session that the pooler then lends to others."""
        probe = f"{_PROBE_PREFIX}{uuid.uuid4().hex}"
        with (
            psycopg.connect(self._conninfo, **self._connect_kwargs) as sender,
            sender.cursor(row_factory=tuple_row) as cur,
        ):
            cur.execute(_NOTIFY_PROBE, [CLAIMABLE_CHANNEL, probe], prepare=False)
        deadline = time.monotonic() + _PROBE_SECONDS
        while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
            for notify in conn.notifies(timeout=min(left, _LISTEN_SLICE_SECONDS)):
                if notify.payload == probe:
                    return True
                if notify.channel == CLAIMABLE_CHANNEL and self._accepts(notify.payload):
                    self._post()
        return False

    def _receive(self, conn: psycopg.Connection[Any]) -> None:
        while not self._stop.is_set():
            for notify in conn.notifies(timeout=_LISTEN_SLICE_SECONDS):
                if notify.channel == CLAIMABLE_CHANNEL and self._accepts(notify.payload):
                    self._post()
