"""The project's loggers: every value a log line carries is shown as one line of visible text.

Run ids, worker names, agent slugs and error texts come from users and agents. Printed raw, a
CR/LF in one forges whole log lines, an ESC/OSC sequence reaches the operator's terminal, a bidi
control reorders what follows. `logger(name)` gives a logger whose arguments go through the
CLI's own escaping (`display.escape`: control characters, bidi controls, line separators and
lone surrogates as backslash escapes) and are cut past `MAX_VALUE_LENGTH` characters with a
marker saying how many were cut; numbers pass as they are. An exception logged with it
(`exc_info`) keeps its traceback's frames, and each exception's own text is escaped the same
way, so whatever handler or formatter the application configures receives safe text.
"""

from __future__ import annotations

import logging
import sys
import traceback
from collections.abc import Mapping, MutableMapping
from typing import Any, Final

from agent_runs.display import escape

# A value longer than this is cut in a log line (the failure fact itself is in the database).
MAX_VALUE_LENGTH: Final = 1000
_PASS_THROUGH: Final = (int, float)
# What Python prints between chained exceptions (kept as they are; anything else is escaped).
_CHAIN_LINES: Final = (
    "\nThe above exception was the direct cause of the following exception:\n\n",
    "\nDuring handling of the above exception, another exception occurred:\n\n",
)


def visible(value: object) -> object:
    """`value` as it may appear in a log line: numbers as they are, anything else escaped and
    cut to MAX_VALUE_LENGTH characters with a marker."""
    if isinstance(value, _PASS_THROUGH) and not isinstance(value, bool):
        return value
    try:
        text = value if isinstance(value, str) else str(value)
    except Exception:  # a value that cannot print itself is named, not raised
        text = f"<unprintable {type(value).__name__}>"
    if len(text) > MAX_VALUE_LENGTH:
        cut = len(text) - MAX_VALUE_LENGTH
        text = f"{text[:MAX_VALUE_LENGTH]} … [truncated {cut} characters]"
    # Every character escape changes is a backslash or one isprintable() refuses (categories
    # Cc, Cf, Cs, Zl, Zp): the usual value (a run id, a worker name) passes at C speed.
    if text.isprintable() and "\\" not in text:
        return text
    return escape(text)


def exception_lines(exc: BaseException) -> str:
    """A traceback whose frames are as Python prints them and whose exception texts (of the
    whole chain) are each one escaped line."""
    lines: list[str] = []
    for part in traceback.TracebackException.from_exception(exc).format():
        if part.startswith(("Traceback ", "  File ")) or part in _CHAIN_LINES:
            lines.append(part.rstrip("\n"))
        else:  # an exception's own text (or a caret line): the part a value can reach
            lines.append(str(visible(part.rstrip("\n"))))
    return "\n".join(lines)


class SafeLogger(logging.LoggerAdapter[logging.Logger]):
    """A logger whose arguments are `visible` and whose exceptions are escaped."""

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, Any]:
        return msg, kwargs

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        exc_info = kwargs.pop("exc_info", None)
        if exc_info:
            exc = _exception(exc_info)
            if exc is not None:
                msg = f"{msg}\n%s"
                args = (*args, _Preformatted(exception_lines(exc)))
        if len(args) == 1 and isinstance(args[0], Mapping) and args[0]:
            shown: tuple[object, ...] = ({k: visible(v) for k, v in args[0].items()},)
        else:
            shown = tuple(a.text if isinstance(a, _Preformatted) else visible(a) for a in args)
        # The line's origin is our caller, not this method.
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
        self.logger.log(level, msg, *shown, **kwargs)


class _Preformatted:
    """Text this module already made safe (a traceback): not escaped again."""

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text


def _exception(exc_info: object) -> BaseException | None:
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple) and len(exc_info) == 3:
        return exc_info[1] if isinstance(exc_info[1], BaseException) else None
    return sys.exc_info()[1]


def logger(name: str) -> SafeLogger:
    """The logger `name`, escaping what its lines carry (see the module doc)."""
    return SafeLogger(logging.getLogger(name), {})
