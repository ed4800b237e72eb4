"""What a starting dashboard says about itself: where it is served, which database it reads
(the password hidden), whether actions are on, which Host names it answers to, and a warning
when actions are on without a token."""

from __future__ import annotations

from collections.abc import Sequence

from agent_runs.db import redact
from agent_runs.display import escape

TOKEN_ENV = "AGENT_RUNS_DASHBOARD_TOKEN"


def startup_lines(
    url: str,
    dsn: str,
    *,
    allow_cancel: bool,
    token: bool,
    allowed_hosts: Sequence[str] | None,
) -> list[str]:
    notes = (" (token required)" if token else "") + (" (cancel allowed)" if allow_cancel else "")
    lines = [
        f"agent_runs dashboard on {escape(url)}{notes}",
        f"  database: {escape(redact(dsn))}  (the same DSN points `agent-runs` at this data)",
    ]
    if allow_cancel:
        lines.append("  actions: on: cancel, cancel-tree and cancel of selected runs (confirmed)")
    else:
        lines.append("  actions: off (read only; --allow-cancel turns cancel on)")
    lines.append(f"  access: {'a token is required' if token else f'no token ({TOKEN_ENV})'}")
    if allowed_hosts is not None:
        lines.append("  answers to Host: " + ", ".join(escape(h) for h in allowed_hosts))
    if allow_cancel and not token:
        lines.append(
            "  warning: actions are on without a token: any local user or program that reaches "
            f"this port can cancel runs; set {TOKEN_ENV} to require one"
        )
    return lines
