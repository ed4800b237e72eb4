"""Telemetry that never costs a fact or a lease: the application's SDK kept at arm's length.

The SDK's processors, exporters and samplers are the application's, and they misbehave (a
buggy processor raises, a synchronous exporter blocks while the collector is down). So:

- every hook of agent_runs.telemetry runs `guarded`: an exception from the SDK is logged once
  per hook and kind of error, and swallowed: the call that committed still answers what it
  committed;
- inside `deferred()` (the worker's claim statements, its heartbeat round), the hooks a thread
  calls are queued and run only when the block ends, after the block tracked the leases it
  claimed or renewed: whatever the SDK does then, and however long it takes, the leases are
  already in the heartbeat's hands.

Imports nothing of opentelemetry: the worker uses `deferred()` whether telemetry is on or off.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final, ParamSpec

from agent_runs.display import one_line
from agent_runs.logs import logger

log = logger("agent_runs.telemetry")

_P = ParamSpec("_P")
_MAX_COMPLAINTS: Final = 1000  # distinct (hook, error) pairs remembered; later ones stay quiet


class _Deferring(threading.local):
    jobs: list[Callable[[], None]] | None = None


_local = _Deferring()
_complained: set[tuple[str, str]] = set()
_complained_lock = threading.Lock()


def complain(where: str, exc: BaseException) -> None:
    """Log an SDK's exception the first time a hook meets it (then only at debug level)."""
    key = (where, type(exc).__qualname__)
    with _complained_lock:
        first = key not in _complained and len(_complained) < _MAX_COMPLAINTS
        if first:
            _complained.add(key)
    level = logging.WARNING if first else logging.DEBUG
    log.log(
        level,
        "telemetry: %s failed in the OpenTelemetry SDK (%s); ignored, the run's facts are "
        "written (logged once per kind)",
        where,
        one_line(exc, with_type=True),
    )


def guarded(hook: Callable[_P, None]) -> Callable[_P, None]:
    """A telemetry hook that never raises, and that waits for the end of `deferred()` when the
    calling thread is inside one."""
    where = hook.__name__

    @functools.wraps(hook)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> None:
        jobs = _local.jobs
        if jobs is not None:
            jobs.append(functools.partial(call, *args, **kwargs))  # guarded when it runs
            return
        try:
            hook(*args, **kwargs)
        except Exception as exc:
            complain(where, exc)

    return call


def safely(where: str, call: Callable[[], Any], default: Any = None) -> Any:
    """`call()`, or `default` when the SDK raises (logged once)."""
    try:
        return call()
    except Exception as exc:
        complain(where, exc)
        return default


@contextmanager
def deferred() -> Iterator[None]:
    """Queue the telemetry hooks this thread calls inside the block; run them (guarded, in
    order) when it ends. Nested blocks run theirs at the end of the outermost one."""
    if _local.jobs is not None:
        yield
        return
    jobs: list[Callable[[], None]] = []
    _local.jobs = jobs
    try:
        yield
    finally:
        _local.jobs = None
        for job in jobs:
            job()
