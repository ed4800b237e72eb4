"""Text for humans: values from users and agents printed as one cell, never as control codes,
and exceptions told in one line."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterable, Sequence
from typing import Final

# Bidi controls that reorder what follows them on screen (the "Trojan source" characters).
_BIDI: Final = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_NAMED: Final = {"\n": "\\n", "\r": "\\r", "\t": "\\t", "\x1b": "\\e"}


def escape(value: object) -> str:
    """`value` as one line of visible text: control characters (C0, C1, DEL, ESC, CR/LF),
    bidi overrides, line/paragraph separators and lone surrogates become backslash escapes;
    a backslash itself is doubled so that an escape can be told from the text `\\n`."""
    text = value if isinstance(value, str) else str(value)
    out: list[str] = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch in _NAMED:
            out.append(_NAMED[ch])
        elif unsafe(ch):
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")
        else:
            out.append(ch)
    return "".join(out)


def unsafe(ch: str) -> bool:
    """True for a character that must not reach a screen as it is: a control character (C0, C1,
    DEL), a bidi control, a line or paragraph separator, a lone surrogate."""
    if ch in _BIDI:
        return True
    category = unicodedata.category(ch)
    # Cc: C0/C1/DEL; Cs: lone surrogates; Zl/Zp: U+2028/U+2029 line breaks.
    return category in ("Cc", "Cs", "Zl", "Zp")


def aligned(rows: Iterable[Sequence[str]]) -> list[str]:
    """Rows of printable cells (the first one the header) as an aligned table, a rule under the
    header. Cells must already be safe to print: pass values from users and agents through
    `escape`."""
    cells = [list(row) for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cells[0]))]
    out = [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in cells
    ]
    out.insert(1, "  " + "  ".join("-" * w for w in widths))
    return out


def exception_text(exc: BaseException) -> str:
    """`Type: message`, or `Type` alone; never raises, even for an exception whose __str__ does."""
    name = type(exc).__name__
    try:
        text = str(exc)
    except BaseException as failure:  # an agent's exception may fail to print itself
        try:
            why = type(failure).__name__
        except BaseException:  # pragma: no cover - defensive
            why = "an error"
        return f"{name}: <the exception could not be printed: {why}>"
    return f"{name}: {text}" if text else name


def one_line(exc: BaseException, *, with_type: bool = False) -> str:
    """The exception's message on one line (each run of white space, line breaks included, one
    space), or its type's name when the message is empty or cannot be printed; `with_type`:
    `Type: message` (`exception_text`) on one line. Never raises."""
    if with_type:
        return " ".join(exception_text(exc).split())
    try:
        text = " ".join(str(exc).split())
    except Exception:  # an exception that cannot print itself is named by its type
        text = ""
    return text or type(exc).__name__
