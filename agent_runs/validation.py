"""Input checks that run before any SQL: a bad argument is refused by name, nothing is written.

Every limit of the module in one place (hence its length): one small function per argument kind.

Limits (the schema enforces the same time window, see migrations/0003_timestamp_bounds.sql):

- Identifiers (run_id, request_id, thread_id, uid, agent_slug, created_by_run_id): a str of
  1-64 characters; worker_id 1-128. No NUL, no lone surrogates (text must encode as UTF-8).
- Time window: every timestamp the module writes lies in [2000-01-01, 9000-01-01) UTC. A given
  `now` must be timezone-aware (any offset Python accepts; it is converted to UTC here), and
  `now` as well as `now + lease_seconds` must lie inside the window.
- lease_seconds: a finite number, 0 < x <= 86400 (huge ints are refused, never overflow).
- JSON (input_payload, manifest): an object of strict JSON: str keys, finite floats, ints of
  fewer than 4,000 digits, no NUL and no lone surrogate in any key or string, at most 64
  nested containers (checked iteratively: no recursion, whatever the depth of the input).
- error_message is never refused but made storable (see `error_message`); error_type is
  refused when invalid from a direct caller, and kept inside the message by `agent_error`.
- Worker settings: name 1-95 characters (owner tokens are `name:` + 32 hex digits, <= 128),
  heartbeat_seconds below lease_seconds, max_tries 1-1,000,000, poll_seconds 0 < x <= 3600.
- timeout_seconds (wait_for_run): a finite number, 0 <= x <= 366 days. Every number is checked
  without converting it first: a huge int is refused by name, never an OverflowError.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any, Final

from agent_runs.errors import InvalidArgument
from agent_runs.models import TERMINAL_STATUSES, RunStatus

MAX_ID_LENGTH: Final = 64
MAX_WORKER_ID_LENGTH: Final = 128
# Owner tokens are f"{name}:{uuid4().hex}": the name leaves room for ":" and 32 hex digits.
MAX_WORKER_NAME_LENGTH: Final = MAX_WORKER_ID_LENGTH - 33
MAX_ERROR_TYPE_LENGTH: Final = 64
MAX_ERROR_MESSAGE_LENGTH: Final = 8192
MAX_LEASE_SECONDS: Final = 86400
MAX_POLL_SECONDS: Final = 3600
# A wait longer than a year is a mistake, not a plan (and keeps deadlines far from overflow).
MAX_TIMEOUT_SECONDS: Final = 366 * 86400
MAX_TRIES: Final = 1_000_000
# Threads of one `agent-runs worker` process (each may hold a pooled database connection).
MAX_CONCURRENCY: Final = 1000
MAX_LIMIT: Final = 100_000
MAX_BATCH: Final = 1000  # runs per claim_next_attempts / finish_runs call
MAX_DSN_LENGTH: Final = 4096
MAX_JSON_DEPTH: Final = 64
# Python refuses to print ints of more than 4,300 digits by default; jsonb would keep them,
# but they could not be read back. One bound below both.
MAX_JSON_INT: Final = 10**4000
# The window of every timestamp the schema accepts: [TIME_MIN, TIME_MAX).
TIME_MIN: Final = datetime(2000, 1, 1, tzinfo=UTC)
TIME_MAX: Final = datetime(9000, 1, 1, tzinfo=UTC)
INVALID_ERROR_TYPE: Final = "invalid_error_type"
# An invalid error_type is kept in the message as the first this-many characters of its repr.
MAX_BAD_ERROR_TYPE_SHOWN: Final = 100
# The marker `error_message` appends to a message it cut (N > 0 characters cut).
_CUT_MARKER: Final = re.compile(r" … \[truncated [1-9][0-9]* characters\]")
RUN_TYPES: Final = frozenset({"chat", "resume", "subagent"})
_HEX = frozenset("0123456789abcdef")
_REPLACEMENT: Final = "\ufffd"


def _plain(value: str) -> str:
    """A str subclass (an enum member, say) as the plain str it holds."""
    return value if type(value) is str else str.__str__(value)


def _encodable(value: str) -> bool:
    """False when the text holds a surrogate code point (not valid Unicode, not storable)."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _text(name: str, value: object, max_length: int) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(f"{name} must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidArgument(f"{name} must not be empty")
    if len(value) > max_length:
        raise InvalidArgument(f"{name} must be at most {max_length} characters, got {len(value)}")
    if "\x00" in value:
        raise InvalidArgument(f"{name} must not contain NUL characters")
    if not _encodable(value):
        raise InvalidArgument(f"{name} must be valid Unicode (it holds a lone surrogate)")
    return _plain(value)


def identifier(name: str, value: object) -> str:
    """run_id, request_id, thread_id, uid, agent_slug, created_by_run_id: 1-64 chars, no NUL."""
    return _text(name, value, MAX_ID_LENGTH)


def optional_identifier(name: str, value: object) -> str | None:
    return None if value is None else identifier(name, value)


def worker_id(value: object, name: str = "worker_id") -> str:
    return _text(name, value, MAX_WORKER_ID_LENGTH)


def optional_worker_id(value: object) -> str | None:
    return None if value is None else worker_id(value)


def _seconds(
    name: str, value: object, low: float, high: float, *, low_allowed: bool = False
) -> float:
    """A finite number with low < value <= high (low <= value with `low_allowed`), as a float
    (bool and huge ints refused)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(f"{name} must be a number, got {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf
    above_low = low <= seconds if low_allowed else low < seconds
    if not math.isfinite(seconds) or not above_low or not seconds <= high:
        shown = f"{type(value).__name__} out of range" if seconds == math.inf else repr(seconds)
        sign = ">=" if low_allowed else ">"
        raise InvalidArgument(f"{name} must be finite, {sign} {low:g} and <= {high:g}, got {shown}")
    return seconds


def timeout_seconds(value: object, name: str = "timeout_seconds") -> float:
    """How long a call may wait: a finite number, 0 <= x <= MAX_TIMEOUT_SECONDS."""
    return _seconds(name, value, 0, MAX_TIMEOUT_SECONDS, low_allowed=True)


def every_seconds(value: object, name: str = "--every") -> float:
    """A repeating command's period: a finite number, 0 < x <= 86400."""
    return _seconds(name, value, 0, MAX_LEASE_SECONDS)


def lease_seconds(value: object) -> float:
    return _seconds("lease_seconds", value, 0, MAX_LEASE_SECONDS)


def now(value: object, lease_seconds: float | None = None) -> datetime | None:
    """An injected clock: timezone-aware, returned in UTC; None means the database's now().

    `now` and, when `lease_seconds` (already checked) is given, `now + lease_seconds` must lie
    in [TIME_MIN, TIME_MAX), the window the schema accepts.
    """
    if value is None:
        return None
    if not isinstance(value, datetime):
        raise InvalidArgument(f"now must be a datetime or None, got {type(value).__name__}")
    utc = instant("now", value)
    if lease_seconds is not None and utc + timedelta(seconds=lease_seconds) >= TIME_MAX:
        raise InvalidArgument(
            f"now + lease_seconds must be before {TIME_MAX} UTC, got now {utc} "
            f"and lease_seconds {lease_seconds!r}"
        )
    # A plain datetime: psycopg sends exactly this instant, whatever the subclass.
    return datetime(
        utc.year, utc.month, utc.day, utc.hour, utc.minute, utc.second, utc.microsecond, UTC
    )


def instant(name: str, value: datetime) -> datetime:
    """An aware datetime in UTC inside [TIME_MIN, TIME_MAX); naive, broken or out-of-range
    ones are refused by name (never an OverflowError from the conversion)."""
    try:
        offset = value.utcoffset()
    except Exception as exc:  # a broken tzinfo: its own error, named
        raise InvalidArgument(f"{name} has a tzinfo that fails: {_shown(exc)}") from None
    if offset is None:
        raise InvalidArgument(f"{name} must be timezone-aware (naive datetimes are ambiguous)")
    try:
        utc = value.astimezone(UTC)
    except (OverflowError, ValueError):
        raise InvalidArgument(f"{name} must lie in [{TIME_MIN}, {TIME_MAX}) UTC") from None
    if not TIME_MIN <= utc < TIME_MAX:
        raise InvalidArgument(f"{name} must lie in [{TIME_MIN}, {TIME_MAX}) UTC, got {utc}")
    return utc


def lease(seconds: object, at: object) -> dict[str, Any]:
    """The `lease_seconds` and `now` parameters of a transition that sets a lease: both checked
    (`now + lease_seconds` inside the window too), the lease once."""
    checked = lease_seconds(seconds)
    return {"lease_seconds": checked, "now": now(at, checked)}


def terminal_status(value: object) -> RunStatus:
    try:
        status = RunStatus(value) if isinstance(value, str) else RunStatus(repr(value))
    except ValueError:
        raise InvalidArgument(f"status must be a run status, got {_shown(value)}") from None
    if status not in TERMINAL_STATUSES:
        terminal = ", ".join(sorted(TERMINAL_STATUSES))
        raise InvalidArgument(f"status must be terminal ({terminal}), got {status.value!r}")
    return status


def error_type(value: object) -> str | None:
    if value is None:
        return None
    return _text("error_type", value, MAX_ERROR_TYPE_LENGTH)


def _storable(text: str) -> str:
    """Text PostgreSQL can store: surrogate pairs joined, lone surrogates and NUL -> U+FFFD."""
    text = _plain(text)
    if not _encodable(text):
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


def _shown(value: object, limit: int = 200) -> str:
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
    head = f"error_type {_shown(error_type_, MAX_BAD_ERROR_TYPE_SHOWN)} was not storable ({reason})"
    if error_message_ is None:
        return INVALID_ERROR_TYPE, error_message(head)
    return INVALID_ERROR_TYPE, error_message(f"{head}: {_str_of(error_message_)}")


def fingerprint(value: object) -> str:
    if not isinstance(value, str) or len(value) != 64 or not _HEX.issuperset(value):
        raise InvalidArgument("fingerprint must be 64 lowercase hex characters (SHA-256)")
    return _plain(value)


def _scalar(name: str, value: object, as_stored: bool) -> object:
    """A JSON scalar as a plain value; `as_stored`: numbers as jsonb gives them back."""
    if value is None or value is True or value is False:
        return value
    if isinstance(value, str):
        if "\x00" in value:
            raise InvalidArgument(f"{name} must be strict JSON: a string holds NUL (\\u0000)")
        if not _encodable(value):
            raise InvalidArgument(f"{name} must be strict JSON: a string holds a lone surrogate")
        return _plain(value)
    if isinstance(value, int):
        if not -MAX_JSON_INT < value < MAX_JSON_INT:
            raise InvalidArgument(f"{name} must be strict JSON: an int has 4,000 digits or more")
        return int(value)
    if isinstance(value, float):
        number = float(value)
        if not math.isfinite(number):
            raise InvalidArgument(f"{name} must be strict JSON: {number!r} is not a JSON number")
        if as_stored:
            return _as_jsonb(number)
        return number
    raise InvalidArgument(
        f"{name} must be strict JSON: a value of type {type(value).__name__} is not JSON"
    )


def _as_jsonb(number: float) -> float | int:
    """The number json.loads makes of jsonb's text for `number` (jsonb stores the decimal
    json.dumps writes, exactly, and prints it without exponent and without a negative zero)."""
    text = repr(number)
    if "e+" in text:  # >= 1e16: printed as digits without a point, read back as an int
        return int(Decimal(text))
    return 0.0 if number == 0 else number


def json_document(name: str, value: object, *, as_stored: bool = False) -> dict[str, Any]:
    """`value` as a plain dict of strict JSON (see the module doc), checked without recursion.

    Mappings become dicts, tuples lists, str/int/float subclasses plain values. With
    `as_stored`, numbers are the ones a jsonb round trip gives back.
    """
    if not isinstance(value, Mapping):
        raise InvalidArgument(f"{name} must be a JSON object (dict), got {type(value).__name__}")
    root: dict[str, Any] = {}
    # (source container, its plain copy, depth of the source)
    stack: list[tuple[Mapping[Any, Any] | list[Any] | tuple[Any, ...], Any, int]] = [
        (value, root, 1)
    ]
    while stack:
        source, copy, depth = stack.pop()
        is_object = isinstance(source, Mapping)
        items: Iterable[tuple[Any, Any]]
        items = source.items() if isinstance(source, Mapping) else enumerate(source)
        key: Any
        for key, child in items:
            if is_object:
                if not isinstance(key, str):
                    raise InvalidArgument(
                        f"{name} must be strict JSON: key {_shown(key, 60)} is not a string"
                    )
                if "\x00" in key or not _encodable(key):
                    raise InvalidArgument(
                        f"{name} must be strict JSON: a key holds NUL or a lone surrogate"
                    )
            if isinstance(child, Mapping | list | tuple):
                if depth >= MAX_JSON_DEPTH:
                    raise InvalidArgument(
                        f"{name} must nest at most {MAX_JSON_DEPTH} objects/arrays deep"
                    )
                inner: dict[str, Any] | list[Any] = {} if isinstance(child, Mapping) else []
                stack.append((child, inner, depth + 1))
                child_copy: object = inner
            else:
                child_copy = _scalar(name, child, as_stored)
            if is_object:
                copy[_plain(key)] = child_copy
            else:
                copy.append(child_copy)
    return root


def json_object(name: str, value: object) -> dict[str, Any]:
    """A dict of strict JSON (no NaN/Infinity, NUL or lone surrogates, which jsonb refuses)."""
    return json_document(name, value)


def canonical_json(manifest: object) -> str:
    """The canonical JSON text of a manifest as it reads back from jsonb (see the fingerprint)."""
    stored = json_document("manifest", manifest, as_stored=True)
    return json.dumps(stored, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def run_type(value: object) -> str:
    if not isinstance(value, str) or value not in RUN_TYPES:
        raise InvalidArgument(f"run_type must be one of {sorted(RUN_TYPES)}, got {_shown(value)}")
    return _plain(value)


def agent_slugs(value: object, name: str = "agent_slugs") -> list[str] | None:
    """None (every agent) or a non-empty collection of agent slugs; a lone str is refused."""
    if value is None:
        return None
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise InvalidArgument(
            f"{name} must be a list of agent slugs or None, got {type(value).__name__}"
        )
    slugs = [identifier(name, slug) for slug in value]
    if not slugs:
        raise InvalidArgument(f"{name} must not be empty (use None for every agent)")
    return slugs


def integer(name: str, value: object, low: int, high: int) -> int:
    """An int (not a bool) with low <= value <= high."""
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise InvalidArgument(
            f"{name} must be an integer from {low} to {high}, got {_shown(value)}"
        )
    return int(value)


def limit(value: object) -> int:
    return integer("limit", value, 1, MAX_LIMIT)


def leases(value: object) -> tuple[list[str], list[str]]:
    """renew_leases: a mapping run_id -> worker_id, returned as two parallel lists."""
    if not isinstance(value, Mapping):
        raise InvalidArgument("leases must be a mapping of run_id to worker_id")
    run_ids = [identifier("leases run_id", run_id) for run_id in value]
    worker_ids = [worker_id(owner, "leases worker_id") for owner in value.values()]
    return run_ids, worker_ids


def worker_ids(value: object) -> list[str]:
    """claim_next_attempts: 1..MAX_BATCH distinct owner tokens; a lone str is refused."""
    items = _batch("worker_ids", value)
    owners = [worker_id(owner, "worker_ids") for owner in items]
    if len(set(owners)) != len(owners):
        raise InvalidArgument("worker_ids must be distinct (one run per owner token)")
    return owners


def finishes(value: object) -> list[list[str | None]]:
    """finish_runs: 1..MAX_BATCH Finish values of distinct runs, as five parallel lists
    (run_ids, worker_ids, statuses, error_types, error_messages)."""
    items = _batch("finishes", value)
    columns: list[list[str | None]] = [[], [], [], [], []]
    for item in items:
        if not isinstance(item, tuple) or len(item) != 5:
            raise InvalidArgument(
                "finishes must hold Finish(run_id, worker_id, status, error_type, error_message)"
                f" values, got {type(item).__name__}"
            )
        run_id, owner, status, error, message = item
        row = (
            identifier("finishes run_id", run_id),
            worker_id(owner, "finishes worker_id"),
            terminal_status(status).value,
            error_type(error),
            error_message(message),
        )
        for column, field in zip(columns, row, strict=True):
            column.append(field)
    if len(set(columns[0])) != len(columns[0]):
        raise InvalidArgument("finishes must name each run_id once")
    return columns


def _batch(name: str, value: object) -> list[object]:
    if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
        raise InvalidArgument(f"{name} must be a list, got {type(value).__name__}")
    items = list(value)
    if not 1 <= len(items) <= MAX_BATCH:
        raise InvalidArgument(f"{name} must hold 1 to {MAX_BATCH} items, got {len(items)}")
    return items


# -- worker settings ------------------------------------------------------------------------


COMPLETIONS: Final = ("durable", "async")


def completion(value: object) -> str:
    """How a worker writes a run's end: `durable` (counted done once committed) or `async`."""
    if not isinstance(value, str) or value not in COMPLETIONS:
        raise InvalidArgument(f"completion must be 'durable' or 'async', got {_shown(value)}")
    return value


def worker_name(value: object) -> str:
    """A worker's stable name: 1-95 characters, so that `name:<32 hex>` fits a worker_id."""
    return _text("name", value, MAX_WORKER_NAME_LENGTH)


def heartbeat_seconds(value: object, lease_seconds_: float) -> float:
    """Seconds between renewals (lease_seconds already checked): 0 < x < lease_seconds.

    None means a third of the lease.
    """
    if value is None:
        return lease_seconds_ / 3
    seconds = _seconds("heartbeat_seconds", value, 0, lease_seconds_)
    if seconds >= lease_seconds_:
        raise InvalidArgument(
            f"heartbeat_seconds must be below lease_seconds ({lease_seconds_:g}), got {seconds:g}"
        )
    return seconds


def max_tries(value: object) -> int:
    return integer("max_tries", value, 1, MAX_TRIES)


def poll_seconds(value: object) -> float:
    return _seconds("poll_seconds", value, 0, MAX_POLL_SECONDS)


def optional_dsn(name: str, value: object) -> str | None:
    """A connection string (URL or key=value) or None; libpq parses it when it connects."""
    if value is None:
        return None
    return _text(name, value, MAX_DSN_LENGTH)
