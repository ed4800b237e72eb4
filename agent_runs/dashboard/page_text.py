"""Values from users and agents made into bounded, visible text for the pages.

Every string goes through `agent_runs.display.escape` (control characters, bidi controls, line
separators and lone surrogates made visible, as in the CLI's tables) and is cut to a bound, so
that neither a hostile character nor a 5 MB string reaches the page. Jinja then HTML-escapes it.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from agent_runs.display import escape, unsafe
from agent_runs.durations import format_duration

# Longest value shown in a table cell.
CELL_CHARS: Final = 120
# Longest formatted JSON shown on the run page; the whole document is one link away.
JSON_CHARS: Final = 20_000


class Shown(str):
    """Text as shown, and whether it was cut (the page then links to the whole)."""

    cut: bool = False


def shown(value: object, limit: int = CELL_CHARS) -> Shown:
    """`value` escaped to visible text and cut to `limit` characters with a marker."""
    if value is None:
        return Shown("")
    text = value if isinstance(value, str) else str(value)
    head = text[: limit + 1]  # escape only what can be shown: a 5 MB string costs nothing
    visible = escape(head)
    if len(text) <= limit and len(visible) <= limit * 4:
        return Shown(visible)
    out = Shown(f"{visible[:limit]} … [{len(text) - min(len(text), limit):,} more characters]")
    out.cut = True
    return out


def lines(value: object, limit: int = CELL_CHARS) -> Shown:
    """Like `shown`, but the text keeps its line breaks (a traceback stays a traceback): each
    line is escaped on its own; CRLF counts as a line break, a lone CR is made visible."""
    if value is None:
        return Shown("")
    text = value if isinstance(value, str) else str(value)
    head = text[:limit].replace("\r\n", "\n")
    visible = "\n".join(escape(line) for line in head.split("\n"))
    if len(text) <= limit:
        return Shown(visible)
    out = Shown(f"{visible} … [{len(text) - limit:,} more characters]")
    out.cut = True
    return out


def cut(text: str, limit: int) -> Shown:
    """Text that is already visible (escaped by its producer, as `explain_run`'s is) cut to
    `limit` characters with a marker; escaping it again would double its backslashes."""
    if len(text) <= limit:
        return Shown(text)
    out = Shown(f"{text[:limit]} … [{len(text) - limit:,} more characters]")
    out.cut = True
    return out


def json_text(document: object, limit: int = JSON_CHARS) -> Shown:
    """A JSON document formatted over lines, characters that could hide or reorder text
    written as JSON escapes (still valid JSON), cut to `limit` characters."""
    if document is None:
        return Shown("")
    text = json.dumps(document, indent=2, ensure_ascii=False, sort_keys=True)
    visible = "".join(_json_char(ch) for ch in text[: limit + 1])
    if len(text) <= limit:
        return Shown(visible)
    out = Shown(f"{visible[:limit]}\n… [cut: {len(text) - limit:,} more characters]")
    out.cut = True
    return out


def _json_char(ch: str) -> str:
    # json.dumps leaves these raw with ensure_ascii=False; a JSON escape keeps the text valid.
    if ch != "\n" and unsafe(ch):
        return f"\\u{ord(ch):04x}"
    return ch


def iso(value: datetime | None) -> str:
    """The absolute time, UTC, for a <time datetime> attribute and its text."""
    if value is None:
        return ""
    return value.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def ago(value: datetime | None, now: datetime) -> str:
    """`3m12s ago` / `in 40s`, relative to the page's clock."""
    if value is None:
        return "never"
    delta = now - value
    if delta >= timedelta(0):
        return f"{format_duration(delta)} ago"
    return f"in {format_duration(-delta)}"


def duration(start: datetime | None, end: datetime | None) -> str:
    """As the CLI prints it: milliseconds under a minute (0.001s), then 3m12s, 5h03m."""
    if start is None or end is None:
        return ""
    return seconds(end - start)


def seconds(value: timedelta | float) -> str:
    """A duration with the CLI's precision: 0.001s under a minute, then 3m12s, 5h03m."""
    delta = value if isinstance(value, timedelta) else timedelta(seconds=value)
    if delta < timedelta(minutes=1):
        return f"{max(0.0, delta.total_seconds()):.3f}s"
    return format_duration(delta)


def plain(value: Any) -> Any:
    """A value for JSON output: datetimes as ISO 8601, everything else as is."""
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    return value
