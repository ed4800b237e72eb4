"""The `Host` header allow-list: a request whose Host names none of the dashboard's own names
is refused before any other work.

Without it, DNS rebinding turns a foreign page into a same-origin one: a name the attacker
controls resolves to 127.0.0.1, the browser sends `Host: evil.example:8765`, and the page reads
the dashboard (and passes its Origin check) as if it were its own.

An entry is a name or an address, with an optional port: `dash.example.com` matches that name
on any port, `dash.example.com:8443` only on that port, an IPv6 address is written in brackets
(`[::1]:8765`). Names compare without case and without a trailing dot.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from agent_runs.errors import InvalidArgument

LOOPBACK_NAMES: Final = ("localhost", "127.0.0.1", "[::1]")
_MAX_ENTRY: Final = 261  # a 253-character DNS name, a colon and a port
_DEFAULT_PORTS: Final = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class HostEntry:
    name: str
    port: int | None  # None: any port


def _split(text: str) -> tuple[str, str | None] | None:
    """(name, port text or None) of `host[:port]` / `[v6][:port]`; None when malformed."""
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            return None
        name, rest = text[: close + 1], text[close + 1 :]
        if not rest:
            return name, None
        return (name, rest[1:]) if rest.startswith(":") else None
    if text.count(":") > 1:
        return None  # an IPv6 address must be bracketed
    name, colon, port = text.partition(":")
    return name, (port if colon else None)


def _name(text: str) -> str:
    return text.lower().removesuffix(".")


def parse_entry(text: object) -> HostEntry:
    """One allow-list entry; InvalidArgument (naming allowed_hosts) when it is not one."""
    if not isinstance(text, str) or not text or len(text) > _MAX_ENTRY:
        raise InvalidArgument(
            f"allowed_hosts entries must be host names of 1 to {_MAX_ENTRY} characters"
        )
    if not text.isascii() or not text.isprintable() or any(c in text for c in " /\\@?#,"):
        raise InvalidArgument(
            "allowed_hosts entries must be ASCII host names or addresses with an optional "
            "':port' (IPv6 in brackets), without spaces"
        )
    parts = _split(text)
    if parts is None or not parts[0] or parts[0] == "[]":
        raise InvalidArgument("allowed_hosts entries must look like name, name:port or [v6]:port")
    name, port_text = parts
    if name.startswith("["):
        try:
            ipaddress.IPv6Address(name[1:-1])
        except ValueError:
            raise InvalidArgument(
                "allowed_hosts: a bracketed entry must be an IPv6 address"
            ) from None
    port: int | None = None
    if port_text is not None:
        if not (port_text.isdigit() and 0 < int(port_text) < 65536):
            raise InvalidArgument("allowed_hosts: a port must be from 1 to 65535")
        port = int(port_text)
    return HostEntry(_name(name), port)


def host_literal(host: str) -> str:
    """An address as it appears in a Host header (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def served_hosts(bind_host: str, port: int, extra: Iterable[str] = ()) -> list[str]:
    """The allow-list of a dashboard bound to `bind_host:port`: that address, the loopback
    names on that port, and `extra` (the names a proxy or the network reaches it by)."""
    entries = [f"{host_literal(bind_host)}:{port}"]
    entries += [f"{name}:{port}" for name in LOOPBACK_NAMES]
    entries += list(extra)
    return list(dict.fromkeys(entries))


class HostAllowList:
    """Whether a request's Host header names this dashboard."""

    def __init__(self, entries: Iterable[object]) -> None:
        if isinstance(entries, str | bytes):
            raise InvalidArgument("allowed_hosts must be a list of host names, not one string")
        try:
            parsed = [parse_entry(entry) for entry in entries]
        except TypeError:
            raise InvalidArgument("allowed_hosts must be a list of host names") from None
        if not parsed:
            raise InvalidArgument("allowed_hosts must name at least one host (or be None)")
        self.any_port = frozenset(e.name for e in parsed if e.port is None)
        self.exact = frozenset((e.name, e.port) for e in parsed if e.port is not None)

    def allows(self, host_header: bytes | None, scheme: str) -> bool:
        if not host_header:
            return False
        try:
            text = host_header.decode("ascii")
        except UnicodeDecodeError:
            return False
        parts = _split(text.strip())
        if parts is None:
            return False
        name, port_text = _name(parts[0]), parts[1]
        if port_text is None:
            port = _DEFAULT_PORTS.get(scheme, 80)
        elif port_text.isdigit() and len(port_text) <= 5:
            port = int(port_text)
        else:
            return False
        return name in self.any_port or (name, port) in self.exact
