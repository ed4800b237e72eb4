"""A TCP relay in front of PostgreSQL that counts the round trips the server answered."""

from __future__ import annotations

import contextlib
import socket
import threading
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo


class RoundTripCounter:
    """A TCP relay in front of the server that counts ReadyForQuery messages: one per round
    trip the server answered (a pipelined BEGIN, statement, COMMIT is one; so is a simple
    query). Exact, where pg_stat_database's counters are flushed lazily (and, on PostgreSQL
    15, count more than the statements run)."""

    def __init__(self, url: str) -> None:
        params = conninfo_to_dict(url)
        host = str(params.get("host") or "localhost")
        port = int(params.get("port") or 5432)
        if host.startswith("/"):
            self._upstream: tuple[int, Any] = (socket.AF_UNIX, f"{host}/.s.PGSQL.{port}")
        else:
            self._upstream = (socket.AF_INET, (host, port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        # No SSL or GSS negotiation: the relay reads plain protocol messages.
        self.url = make_conninfo(
            url,
            host="127.0.0.1",
            port=self._listener.getsockname()[1],
            sslmode="disable",
            gssencmode="disable",
        )
        self.count = 0
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False

    def __enter__(self) -> RoundTripCounter:
        threading.Thread(target=self._accept, name="round-trip-relay", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            family, address = self._upstream
            server = socket.socket(family, socket.SOCK_STREAM)
            try:
                server.connect(address)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, from_server: bool) -> None:
        pending = b""
        try:
            while data := source.recv(65536):
                sink.sendall(data)
                if from_server:
                    pending = self._count_messages(pending + data)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _count_messages(self, buffer: bytes) -> bytes:
        """Count whole ReadyForQuery ('Z') messages; return the incomplete tail."""
        at = 0
        while len(buffer) - at >= 5:
            length = int.from_bytes(buffer[at + 1 : at + 5], "big")
            if len(buffer) - at < 1 + length:
                break
            if buffer[at : at + 1] == b"Z":
                with self._lock:
                    self.count += 1
            at += 1 + length
        return buffer[at:]
