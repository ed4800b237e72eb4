"""The connection under a pipeline: waiting on its socket, reading the results up to the Sync,
and leaving it usable (or closed) after an interrupted exchange or a failed statement."""

from __future__ import annotations

import select
import time
from typing import Final

import psycopg
from psycopg import pq
from psycopg.pq.abc import PGconn, PGresult

_PIPELINE_SYNC: Final = pq.ExecStatus.PIPELINE_SYNC
_IDLE: Final = pq.TransactionStatus.IDLE
_PIPELINE_OFF: Final = pq.PipelineStatus.OFF
_CONN_OK: Final = pq.ConnStatus.OK

_READ: Final = select.POLLIN if hasattr(select, "POLLIN") else 1
_WRITE: Final = select.POLLOUT if hasattr(select, "POLLOUT") else 4


def _wait(pgconn: PGconn, events: int, deadline: float | None) -> int:
    """Block until the connection's socket is ready for `events` (or errors); the ready events.
    Raises TimeoutError past `deadline` (time.monotonic())."""
    fileno = pgconn.socket
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        if hasattr(select, "poll"):
            poller = select.poll()
            poller.register(fileno, events)
            ready = poller.poll(None if timeout is None else timeout * 1000)
            if ready:
                return ready[0][1]
        else:  # pragma: no cover - platforms without poll()
            readable, writable, broken = select.select(
                [fileno] if events & _READ else [],
                [fileno] if events & _WRITE else [],
                [fileno],
                timeout,
            )
            if readable or writable or broken:
                return (_READ if readable or broken else 0) | (_WRITE if writable else 0)
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError("the server did not answer in time")


def _flush(pgconn: PGconn, deadline: float | None) -> None:
    """Send everything libpq holds, reading meanwhile so that a full socket cannot deadlock."""
    while pgconn.flush():
        if _wait(pgconn, _READ | _WRITE, deadline) & _READ:
            pgconn.consume_input()


def _read(pgconn: PGconn, deadline: float | None) -> None:
    """Read from the socket until a whole result is in."""
    while pgconn.is_busy():
        _wait(pgconn, _READ, deadline)
        pgconn.consume_input()


def exchange(pgconn: PGconn) -> list[PGresult]:
    """Flush the pipeline and read one result per command, up to the Sync.

    The server answers the whole pipeline at once, so after the first wait every result is
    usually in libpq's buffer already, and is read straight from it. Each command's result is
    followed by a NULL that libpq hands out without reading, so only a command's first result
    needs the check that it is whole (each wait releases the GIL: when threads share the
    process, every release can hand the GIL to another thread and back, so they are kept few).
    """
    _flush(pgconn, None)
    results: list[PGresult] = []
    while True:
        if pgconn.is_busy():
            _read(pgconn, None)
        result = pgconn.get_result()
        if result is None:  # pragma: no cover - libpq ends a command's results with one NULL
            continue
        if result.status == _PIPELINE_SYNC:
            break
        results.append(result)
        if pgconn.get_result() is not None:  # pragma: no cover - one result per command
            raise psycopg.InterfaceError("a pipelined command returned more than one result")
    handler = pgconn.notify_handler
    if handler is not None:  # the connection LISTENs: deliver what came with the answer
        while notify := pgconn.notifies():
            handler(notify)
    return results


_ABANDON_SECONDS: Final = 5.0


def abandon(pgconn: PGconn, *, synced: bool) -> None:
    """Leave the connection usable after an interrupted exchange, or close it.

    Reads what is left up to the Sync, leaves pipeline mode and rolls back. A connection whose
    protocol state is unknown must not carry another transition, so if any of that fails or
    takes too long, it is closed (a pool replaces it).
    """
    if pgconn.status != _CONN_OK:
        return
    deadline = time.monotonic() + _ABANDON_SECONDS
    try:
        if pgconn.pipeline_status != _PIPELINE_OFF:
            if not synced:
                pgconn.pipeline_sync()
            _flush(pgconn, deadline)
            while True:
                _read(pgconn, deadline)
                result = pgconn.get_result()
                if result is not None and result.status == _PIPELINE_SYNC:
                    break
            pgconn.exit_pipeline_mode()
        rollback(pgconn, deadline=deadline)
        if pgconn.transaction_status != _IDLE:
            raise psycopg.InterfaceError("the connection is still inside a transaction")
    except BaseException:
        # The error to report is the one that interrupted the exchange, not this one.
        pgconn.finish()


def rollback(pgconn: PGconn, *, deadline: float | None) -> None:
    """End a transaction whose COMMIT did not run (the caller holds the connection's lock)."""
    if pgconn.status != _CONN_OK or pgconn.transaction_status == _IDLE:
        return
    # The error to report is the original one: a failed rollback leaves the connection to die.
    try:
        pgconn.send_query(b"ROLLBACK")
        _flush(pgconn, deadline)
        while True:
            _read(pgconn, deadline)
            if pgconn.get_result() is None:
                return
    except (psycopg.Error, TimeoutError):
        if deadline is not None:
            raise
