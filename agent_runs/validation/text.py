"""Text arguments: identifiers, worker ids, statuses, and failure texts made storable."""

from __future__ import annotations

import re
from typing import Final

from agent_runs.errors import InvalidArgument
from agent_runs.models import TERMINAL_STATUSES, RunStatus
from agent_runs.validation.limits import (
    INVALID_ERROR_TYPE,
    MAX_BAD_ERROR_TYPE_SHOWN,
    MAX_CHECKPOINT_ID_LENGTH,
    MAX_CONCURRENCY_KEY_LENGTH,
    MAX_ERROR_MESSAGE_LENGTH,
    MAX_ERROR_TYPE_LENGTH,
    MAX_ID_LENGTH,
    MAX_WORKER_ID_LENGTH,
    RUN_TYPES,
)

# The marker `error_message` appends to a message it cut (N > 0 characters cut).
_CUT_MARKER: Final = re.compile(r" … \[truncated [1-9][0-9]* characters\]")
_HEX: Final = frozenset("0123456789abcdef")
_REPLACEMENT: Final = "\ufffd"


def plain_str(value: str) -> str:
    """A str subclass (an enum member, say) as the plain str it holds."""
    return value if type(value) is str else str.__str__(value)


def encodable(value: str) -> bool:
    """False when the text holds a surrogate code point (not valid Unicode, not storable)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def bounded_text(name: str, value: object, max_length: int) -> str:
    """A str of 1 to `max_length` characters, without NUL or lone surrogates, as a plain str."""
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidArgument(f"{name} must not be empty")
    if len(value) > max_length:
        raise InvalidArgument(f"{name} must be at most {max_length} characters, got {len(value)}")
    if "\x00" in value:
        raise InvalidArgument(f"{name} must not contain NUL characters")
    if not encodable(value):
        raise InvalidArgument(f"{name} must be valid Unicode (it holds a lone surrogate)")
    return plain_str(value)


def identifier(name: str, value: object) -> str:
    """run_id, request_id, thread_id, uid, agent_slug, created_by_run_id: 1-64 chars, no NUL."""
    return bounded_text(name, value, MAX_ID_LENGTH)


def optional_identifier(name: str, value: object) -> str | None:
    return None if value is None else identifier(name, value)


def worker_id(value: object, name: str = "worker_id") -> str:
    return bounded_text(name, value, MAX_WORKER_ID_LENGTH)


def concurrency_key(value: object, name: str = "concurrency_key") -> str:
    """A concurrency key (a user, agent or provider a limit applies to): 1-128 chars, no NUL."""
    return bounded_text(name, value, MAX_CONCURRENCY_KEY_LENGTH)


def optional_concurrency_key(value: object, name: str = "concurrency_key") -> str | None:
    return None if value is None else concurrency_key(value, name)


def optional_worker_id(value: object) -> str | None:
    return None if value is None else worker_id(value)


def terminal_status(value: object) -> RunStatus:
    try:
        status = RunStatus(value) if isinstance(value, str) else RunStatus(repr(value))
    except ValueError:
        raise InvalidArgument(f"status must be a run status, got {shown(value)}") from None
    if status not in TERMINAL_STATUSES:
        terminal = ", ".join(sorted(TERMINAL_STATUSES))
        raise InvalidArgument(f"status must be terminal ({terminal}), got {status.value!r}")
    return status


def error_type(value: object) -> str | None:
    if value is None:
        return None
    return bounded_text("error_type", value, MAX_ERROR_TYPE_LENGTH)


def _storable(text: str) -> str:
    """Text PostgreSQL can store: surrogate pairs joined, lone surrogates and NUL -> U+FFFD."""
    text = plain_str(text)
    if not encodable(text):
        text = text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace")
    return text.replace("\x00", _REPLACEMENT)


def _str_of(value: object) -> str:
    """str(value), or a description of it when its __str__ itself fails."""
    if isinstance(value, str):
        return value
    try:
        text = str(value)
        if isinstance(text, str):
            return text
    except Exception as exc:
        return f"<unprintable {type(value).__name__}: __str__ raised {type(exc).__name__}>"
    return f"<unprintable {type(value).__name__}>"  # pragma: no cover - str() returns a str


def shown(value: object, limit: int = 200) -> str:
    """repr(value) for a message, made storable and short; never raises."""
    try:
        text = repr(value)
    except Exception:
        text = f"<unrepresentable {type(value).__name__}>"
    text = _storable(text)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [truncated {len(text) - limit} characters]"


def error_message(value: object) -> str | None:
    """Never refused: a failure fact is kept, made storable and cut with a marker.

    Not a str: its str(). Lone surrogates and NUL become U+FFFD; over 8,192 characters, the
    first 8,192 are kept followed by ` … [truncated N characters]` (N characters cut).
    Cutting is done once: a message already cut (8,192 characters and the marker, as this
    function returns it) is kept as it is, so its marker still counts what the first cut took.
    """
    if value is None:
        return None
    text = _storable(_str_of(value))
    if len(text) > MAX_ERROR_MESSAGE_LENGTH and not _CUT_MARKER.fullmatch(
        text, MAX_ERROR_MESSAGE_LENGTH
    ):
        cut = len(text) - MAX_ERROR_MESSAGE_LENGTH
        text = f"{text[:MAX_ERROR_MESSAGE_LENGTH]} … [truncated {cut} characters]"
    return text


def agent_error(error_type_: object, error_message_: object) -> tuple[str | None, str | None]:
    """(error_type, error_message) from an agent, storable whatever they are; nothing is lost.

    A valid error_type is kept; an invalid one (not a str, empty, too long, NUL, lone
    surrogates) becomes `invalid_error_type`, its repr leading the message.
    """
    try:
        return error_type(error_type_), error_message(error_message_)
    except InvalidArgument as exc:
        reason = str(exc)
    # The bad type is told by a short prefix: the agent's own message must follow it whole.
    head = f"error_type {shown(error_type_, MAX_BAD_ERROR_TYPE_SHOWN)} was not storable ({reason})"
    if error_message_ is None:
        return INVALID_ERROR_TYPE, error_message(head)
    return INVALID_ERROR_TYPE, error_message(f"{head}: {_str_of(error_message_)}")


def fingerprint(value: object) -> str:
    if not isinstance(value, str) or len(value) != 64 or not _HEX.issuperset(value):
        raise InvalidArgument("fingerprint must be 64 lowercase hex characters (SHA-256)")
    return plain_str(value)


def run_type(value: object) -> str:
    if not isinstance(value, str) or value not in RUN_TYPES:
        raise InvalidArgument(f"run_type must be one of {sorted(RUN_TYPES)}, got {shown(value)}")
    return plain_str(value)


def checkpoint_id(value: object) -> str:
    """A checkpoint id (where an attempt resumed): 1-128 characters, no NUL."""
    return bounded_text("checkpoint_id", value, MAX_CHECKPOINT_ID_LENGTH)
