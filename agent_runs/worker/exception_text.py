"""Exception text for logs and failure facts, whatever the exception does when printed."""

from __future__ import annotations


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


def one_line(exc: BaseException) -> str:
    return " ".join(exception_text(exc).split())
