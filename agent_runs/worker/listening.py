"""The process's wake-up listener (one LISTEN connection), started by the first claimer that
waits for work and stopped with the worker."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from agent_runs.notify import Wakeups


class Listener:
    """Starts `Wakeups` on `dsn` at first use (none without a dsn, nor after `interrupt`)."""

    def __init__(self, dsn: str | None, *, agent_slugs: Sequence[str] | None) -> None:
        self._dsn = dsn
        self._agent_slugs = agent_slugs
        self._lock = threading.Lock()
        self._wakeups: Wakeups | None = None
        self._closed = False

    @property
    def listening(self) -> bool:
        """True while the listener has LISTEN in force."""
        wakeups = self._wakeups
        return wakeups is not None and wakeups.listening

    def wakeups(self) -> Wakeups | None:
        """The listener, started now if this is its first use; None without a dsn, or once
        interrupted and not started by then."""
        if self._dsn is None:
            return None
        with self._lock:
            if self._wakeups is None and not self._closed:
                self._wakeups = Wakeups(
                    self._dsn,
                    agent_slugs=self._agent_slugs,
                    connect_kwargs={"connect_timeout": 5},
                )
                self._wakeups.start()
            return self._wakeups

    def interrupt(self) -> None:
        """Wake whoever waits on it (the worker stops); no more listener is started."""
        self._closed = True
        wakeups = self._wakeups
        if wakeups is not None:
            wakeups.interrupt()

    def close(self) -> None:
        with self._lock:
            wakeups, self._wakeups = self._wakeups, None
        if wakeups is not None:
            wakeups.close()
