"""What every command shares: usage errors, the DSN, connections, logging, argument types."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Final, NoReturn

import psycopg
from psycopg.conninfo import conninfo_to_dict

from agent_runs.db import connect, no_prepare_from_env

if TYPE_CHECKING:
    from agent_runs.telemetry.sdk_setup import OtelSetup

PROG: Final = "agent-runs"
# libpq gives up on an unreachable server after this long; workers then back off and retry.
CONNECT_TIMEOUT_SECONDS: Final = 5
LOG_LEVELS: Final = ("DEBUG", "INFO", "WARNING", "ERROR")


class UsageError(Exception):
    """Bad usage or input: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def resolve_dsn(dsn: str | None, *, url_only: bool = False) -> str:
    """--dsn, else $DATABASE_URL; a missing or malformed one is a usage error."""
    dsn = dsn or os.environ.get("DATABASE_URL") or None
    if dsn is None:
        raise UsageError("no database: pass --dsn or set DATABASE_URL")
    check_dsn(dsn)
    if url_only and not dsn.startswith(("postgresql://", "postgres://", "postgresql+psycopg://")):
        raise UsageError("migrate needs a postgresql:// URL, not a key=value DSN")
    return dsn


def check_dsn(dsn: str) -> None:
    """Refuse a DSN libpq cannot parse; the message never repeats the DSN (it may hold a
    password)."""
    try:
        conninfo_to_dict(dsn.replace("postgresql+psycopg://", "postgresql://", 1))
    except psycopg.ProgrammingError:
        raise UsageError("invalid DSN: libpq cannot parse it (check its quoting)") from None


def no_prepare(args: argparse.Namespace) -> bool:
    """--no-prepare, or AGENT_RUNS_NO_PREPARE=1: no named prepared statements (poolers)."""
    return bool(getattr(args, "no_prepare", False)) or no_prepare_from_env()


def connect_options(args: argparse.Namespace) -> dict[str, Any]:
    """psycopg connection options for this invocation."""
    options: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT_SECONDS}
    if no_prepare(args):
        options["prepare_threshold"] = None
    return options


def open_connection(args: argparse.Namespace) -> psycopg.Connection[Any]:
    """An autocommit connection to --dsn / $DATABASE_URL, honouring --no-prepare."""
    return connect(resolve_dsn(args.dsn), **connect_options(args))


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)-7s %(name)s [%(process)d %(threadName)s] %(message)s",
    )


OTEL_HELP: Final = (
    "OpenTelemetry traces and metrics, exported as the OTEL_* variables say (default: OTLP "
    "over HTTP); needs agent_runs[otel-cli]"
)


def otel_from_env(args: argparse.Namespace, service_name: str, **options: Any) -> OtelSetup | None:
    """--otel: the SDK configured from the OTEL_* variables (agent_runs.telemetry.sdk_setup), or
    None without it; missing packages are a usage error naming them."""
    if not getattr(args, "otel", False):
        return None
    from agent_runs.telemetry.sdk_setup import configure_from_env

    return configure_from_env(service_name, **options)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (0 < value < float("inf")):
        raise argparse.ArgumentTypeError(f"must be a positive number: {text!r}")
    return value
