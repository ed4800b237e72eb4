"""The metrics of agent_runs.telemetry: instruments, their closed attribute sets, the slug cap.

Imported by agent_runs.telemetry.Telemetry only (it imports opentelemetry). Every attribute set
is built here from closed sets plus the agent slug, capped: run ids, attempt numbers, worker ids
and error messages never label a metric.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Final

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

log = logging.getLogger("agent_runs.telemetry")

SYSTEM: Final = "agent_runs"
OTHER: Final = "_OTHER"  # the OpenTelemetry convention for a value outside the known set

# Attribute keys.
SYSTEM_KEY: Final = "messaging.system"
DESTINATION: Final = "messaging.destination.name"  # the agent slug
OUTCOME: Final = "agent_runs.outcome"
STATUS: Final = "agent_runs.status"
ERROR_TYPE: Final = "error.type"

_BASE: Final = frozenset({SYSTEM_KEY, DESTINATION})
# Each metric's attribute keys: a test holds every data point to this allow-list.
METRIC_ATTRIBUTES: Final[Mapping[str, frozenset[str]]] = {
    "agent_runs.run.created": _BASE,
    "agent_runs.attempt.started": _BASE,
    "agent_runs.attempt.duration": _BASE | {OUTCOME, ERROR_TYPE},
    "agent_runs.pickup.duration": _BASE,
    "agent_runs.lease.renewals": frozenset({SYSTEM_KEY}),
    "agent_runs.lease.lost": _BASE,
    "agent_runs.reconciler.converged": _BASE,
    "agent_runs.worker.active": _BASE,
    "agent_runs.retry.scheduled": _BASE | {"reason"},
    "agent_runs.run.exhausted": _BASE | {ERROR_TYPE},
    "agent_runs.run.count": _BASE | {STATUS},
    "agent_runs.pending.age": _BASE,
}

# error.type on metrics: the worker's and the reconciler's own classifications always; an
# agent's own error_type (open-ended text, e.g. tool_error) as it is, capped as agent slugs are
# (the first max_agent_slugs distinct ones, later ones _OTHER).
METRIC_ERROR_TYPES: Final = frozenset(
    {
        "agent_error",
        "agent_exit",
        "retryable_error",
        "retries_exhausted",
        "lost_leases_exhausted",
        "deadline_exceeded",
        "worker_lease_expired",
        "failed",
        "interrupted",
        "retry_released",
    }
)
# The error types a recovery policy ends a run with (agent_runs.run.exhausted).
EXHAUSTED_ERROR_TYPES: Final = frozenset(
    {"retries_exhausted", "lost_leases_exhausted", "deadline_exceeded"}
)
OUTCOMES: Final = frozenset(
    {"completed", "failed", "cancelled", "interrupted", "retry_released", "lease_expired"}
)

# Seconds: agent attempts run from milliseconds to an hour, pickups from milliseconds to hours.
_SECONDS_BUCKETS: Final = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
    600.0, 1800.0, 3600.0, 7200.0,
)  # fmt: skip

_CACHED_SLUGS: Final = 10_000

QueueRead = Callable[[], list[tuple[str, str, int, float | None]]]


class Slugs:
    """An open-ended value (an agent slug, an agent's error type) as a metric attribute: the
    first `limit` values seen keep their name, any later one is _OTHER, so a stream of new
    values cannot grow the number of series."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._known: dict[str, str] = {}
        self._lock = threading.Lock()

    def __call__(self, slug: str) -> str:
        known = self._known.get(slug)
        if known is not None:
            return known
        with self._lock:
            if slug in self._known:
                return self._known[slug]
            if len(self._known) < self._limit:
                self._known[slug] = slug
                return slug
        return OTHER  # not remembered: the map stays at `limit` entries


class Instruments:
    """The meter `agent_runs` and its instruments (docs/telemetry.md lists them), with cached
    attribute sets."""

    def __init__(self, meter: metrics.Meter, *, max_agent_slugs: int) -> None:
        self.slugs = Slugs(max_agent_slugs)
        self.error_types = Slugs(max_agent_slugs)
        self._base: dict[str, dict[str, str]] = {}
        self._system = {SYSTEM_KEY: SYSTEM}
        self.run_created = meter.create_counter(
            "agent_runs.run.created", unit="{run}", description="Runs created (new rows)."
        )
        self.attempt_started = meter.create_counter(
            "agent_runs.attempt.started",
            unit="{attempt}",
            description="Attempts started: claims that opened an attempt.",
        )
        self.attempt_duration = meter.create_histogram(
            "agent_runs.attempt.duration",
            unit="s",
            description="Attempts from claim to the committed end, by outcome; lost leases are "
            "recorded by the reconciler that converges them.",
            explicit_bucket_boundaries_advisory=_SECONDS_BUCKETS,
        )
        self.pickup_duration = meter.create_histogram(
            "agent_runs.pickup.duration",
            unit="s",
            description="From a run's creation (or its release for retry) to its claim.",
            explicit_bucket_boundaries_advisory=_SECONDS_BUCKETS,
        )
        self.lease_renewals = meter.create_counter(
            "agent_runs.lease.renewals", unit="{renewal}", description="Lease renewals committed."
        )
        self.lease_lost = meter.create_counter(
            "agent_runs.lease.lost",
            unit="{lease}",
            description="Leases a worker lost before it could write its attempt's end.",
        )
        self.reconciler_converged = meter.create_counter(
            "agent_runs.reconciler.converged",
            unit="{run}",
            description="Runs the reconciler converged to failed / worker_lease_expired.",
        )
        self.retry_scheduled = meter.create_counter(
            "agent_runs.retry.scheduled",
            unit="{retry}",
            description="Attempts the recovery policy scheduled again, by reason (failure: a "
            "retryable error; lost_lease: a lease the reconciler found lost).",
        )
        self.run_exhausted = meter.create_counter(
            "agent_runs.run.exhausted",
            unit="{run}",
            description="Runs the recovery policy ended failed, by error.type "
            "(retries_exhausted, lost_leases_exhausted, deadline_exceeded).",
        )
        self.worker_active = meter.create_up_down_counter(
            "agent_runs.worker.active",
            unit="{attempt}",
            description="Attempts this process executes now (claimed, end not yet written).",
        )

    def base(self, slug: str) -> dict[str, str]:
        """{messaging.system, messaging.destination.name} for `slug` (capped), made once."""
        attributes = self._base.get(slug)
        if attributes is None:
            attributes = {SYSTEM_KEY: SYSTEM, DESTINATION: self.slugs(slug)}
            if len(self._base) < _CACHED_SLUGS:  # a stream of new slugs cannot grow it
                self._base[slug] = attributes
        return attributes

    @property
    def system(self) -> dict[str, str]:
        return self._system

    def ended(self, slug: str, outcome: str, error_type: str | None, seconds: float) -> None:
        attributes = dict(self.base(slug))
        attributes[OUTCOME] = outcome if outcome in OUTCOMES else OTHER
        if error_type is not None:
            known = error_type in METRIC_ERROR_TYPES
            attributes[ERROR_TYPE] = error_type if known else self.error_types(error_type)
        self.attempt_duration.record(max(0.0, seconds), attributes)

    def decided(self, slug: str, status: str, error_type: str | None, reason: str) -> None:
        """A recovery decision committed: a retry scheduled (status pending) for `reason`
        (failure / lost_lease), or a run the policy ended (an exhausted error_type)."""
        attributes = dict(self.base(slug))
        if status == "pending":
            attributes["reason"] = reason
            self.retry_scheduled.add(1, attributes)
        elif error_type in EXHAUSTED_ERROR_TYPES:
            attributes[ERROR_TYPE] = error_type
            self.run_exhausted.add(1, attributes)

    def observe_queue(self, meter: metrics.Meter, read: QueueRead) -> QueueGauges:
        return QueueGauges(meter, read, self)


class QueueGauges:
    """agent_runs.run.count and agent_runs.pending.age from one grouped query per collection:
    the first gauge read of a collection runs it, the other reuses its answer."""

    _FRESH_SECONDS: Final = 1.0

    def __init__(self, meter: metrics.Meter, read: QueueRead, instruments: Instruments) -> None:
        import time

        self._clock = time.monotonic
        self._read = read
        self._instruments = instruments
        self._lock = threading.Lock()
        self._taken_at = float("-inf")
        self._rows: list[tuple[str, str, int, float | None]] = []
        self.queries = 0  # how many times the query ran (tests: one per collection)
        meter.create_observable_gauge(
            "agent_runs.run.count",
            callbacks=[self._counts],
            unit="{run}",
            description="Live runs (pending, running, cancel_requested) by status and agent.",
        )
        meter.create_observable_gauge(
            "agent_runs.pending.age",
            callbacks=[self._ages],
            unit="s",
            description="Age of the oldest pending run of each agent (since its creation).",
        )

    def _snapshot(self) -> list[tuple[str, str, int, float | None]]:
        with self._lock:
            if self._clock() - self._taken_at >= self._FRESH_SECONDS:
                self._taken_at = self._clock()
                try:
                    self._rows = self._read()
                    self.queries += 1
                except Exception as exc:  # a slow or absent database must not break the export
                    log.warning("queue gauges: could not read the queue: %s", exc)
                    self._rows = []
                    self._taken_at = float("-inf")  # the next collection tries again
            return self._rows

    def _counts(self, options: CallbackOptions) -> Iterable[Observation]:
        totals: dict[tuple[str, str], int] = {}
        for status, slug, runs, _age in self._snapshot():
            key = (status, self._instruments.slugs(slug))
            totals[key] = totals.get(key, 0) + runs
        return [
            Observation(runs, {SYSTEM_KEY: SYSTEM, DESTINATION: slug, STATUS: status})
            for (status, slug), runs in totals.items()
        ]

    def _ages(self, options: CallbackOptions) -> Iterable[Observation]:
        oldest: dict[str, float] = {}
        for status, slug, _runs, age in self._snapshot():
            if status == "pending" and age is not None:
                key = self._instruments.slugs(slug)
                oldest[key] = max(oldest.get(key, 0.0), age)
        return [
            Observation(age, {SYSTEM_KEY: SYSTEM, DESTINATION: slug})
            for slug, age in oldest.items()
        ]
