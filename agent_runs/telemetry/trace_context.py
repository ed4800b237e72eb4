"""A run's stored trace context (agent_runs.trace_context), made storable as W3C allows; and
Telemetry's argument checks and the small names it gives its scope and its errors.

The caller's trace context is the caller's: its `tracestate` may be longer than the 512
characters the column accepts (W3C allows 32 list-members of up to 256 characters each), and
an SDK with a custom id generator or propagator may produce a `traceparent` of another shape.
Neither may cost the run: a `tracestate` over the limit loses whole list-members from its right
end until it fits (W3C trace context, "Mutating the tracestate field"), or goes entirely when
not even its first member fits; a `traceparent` of any other shape drops the whole context
(NULL, as with telemetry off); a `tracestate` with characters W3C does not allow is dropped.
Imports nothing of opentelemetry.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

from agent_runs.errors import InvalidArgument

SPAN_RELATIONSHIPS: Final = ("link", "child", "none")
# What the column's guard accepts (migration 0010): the W3C shape of traceparent, and at most
# 512 characters of tracestate.
MAX_TRACESTATE: Final = 512
_TRACEPARENT: Final = re.compile(r"[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")
_PRINTABLE: Final = re.compile(r"[\x20-\x7e]*")  # W3C tracestate's characters (no NUL)


def storable(carrier: Mapping[str, object]) -> dict[str, str] | None:
    """{"traceparent", "tracestate"?} as the INSERT may store it, or None when there is none."""
    traceparent = carrier.get("traceparent")
    if not isinstance(traceparent, str) or not _TRACEPARENT.fullmatch(traceparent):
        return None
    found = {"traceparent": traceparent}
    tracestate = carrier.get("tracestate")
    if isinstance(tracestate, str) and _PRINTABLE.fullmatch(tracestate):
        cut = cut_tracestate(tracestate)
        if cut:
            found["tracestate"] = cut
    return found


def cut_tracestate(tracestate: str, limit: int = MAX_TRACESTATE) -> str:
    """`tracestate` if it fits in `limit` characters; else its longest run of whole
    list-members from the left that fits (empty members and surrounding blanks dropped), or ""."""
    if len(tracestate) <= limit:
        return tracestate
    kept: list[str] = []
    length = 0
    for member in (m.strip(" \t") for m in tracestate.split(",")):
        if not member:
            continue
        added = len(member) + (1 if kept else 0)
        if length + added > limit:
            break
        kept.append(member)
        length += added
    return ",".join(kept)


def qualified(kind: type) -> str:
    """An exception type's name as span attribute error.type (module-qualified)."""
    module = kind.__module__
    return kind.__qualname__ if module == "builtins" else f"{module}.{kind.__qualname__}"


def package_version() -> str:
    """agent_runs' version, for the tracer's and meter's scope."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agent_runs")
    except PackageNotFoundError:  # pragma: no cover - a checkout that was never installed
        return "0"


def check_options(
    span_relationship: str, max_agent_slugs: int, queue_statement_timeout_seconds: float
) -> None:
    """Telemetry's own arguments, refused with InvalidArgument naming the argument."""
    if span_relationship not in SPAN_RELATIONSHIPS:
        raise InvalidArgument(
            f"span_relationship must be one of {', '.join(SPAN_RELATIONSHIPS)}, "
            f"not {span_relationship!r}"
        )
    if isinstance(max_agent_slugs, bool) or not isinstance(max_agent_slugs, int):
        raise InvalidArgument("max_agent_slugs must be an int")
    if not 1 <= max_agent_slugs <= 10_000:
        raise InvalidArgument("max_agent_slugs must be between 1 and 10000")
    if not 0 < queue_statement_timeout_seconds <= 60:
        raise InvalidArgument("queue_statement_timeout_seconds must be in (0, 60]")
