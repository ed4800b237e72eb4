"""Templates: one Jinja2 Environment with autoescaping on for every template, whatever its file
name (Starlette's Jinja2Templates escapes only .html), and the responses built from them."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Scope

from agent_runs.dashboard import page_text
from agent_runs.dashboard.guard import dashboard_root, route_path
from agent_runs.models import AttemptOutcome, RunStatus

TEMPLATES_DIR: Final = Path(__file__).resolve().parent / "templates"
HTML: Final = "text/html; charset=utf-8"
# Seconds between the live script's refreshes (the page says so in a data attribute).
REFRESH_SECONDS: Final = 5


def segment(value: object) -> str:
    """A value as one URL path segment or query value of our own links (percent-encoded)."""
    return quote(str(value), safe="")


# A run id of only dots is a dot segment to a browser (even as %2E), which drops it from the
# URL; such an id is written with a NUL after it, which no stored id can hold (the route's
# convertor takes it off again).
DOT_IDS: Final = frozenset({".", ".."})
DOT_MARK: Final = "\x00"


def run_segment(run_id: object) -> str:
    """A run id as the last path segment of our links to its pages."""
    text = str(run_id)
    return segment(text + DOT_MARK if text in DOT_IDS else text)


_KNOWN_STATES: Final = frozenset(
    [s.value for s in RunStatus] + [o.value for o in AttemptOutcome] + ["open"]
)


def state_class(value: object) -> str:
    """The CSS class of a status or outcome: from a closed set, never the value itself."""
    return f"s-{value}" if str(value) in _KNOWN_STATES else "s-unknown"


def make_environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(TEMPLATES_DIR),
        autoescape=True,  # every template, every file name
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(
        shown=page_text.shown,
        lines=page_text.lines,
        cut=page_text.cut,
        iso=page_text.iso,
        json_text=page_text.json_text,
        seg=segment,
        idseg=run_segment,
        duration=page_text.duration,
        seconds=page_text.seconds,
        state=state_class,
    )
    return env


def page(
    env: Environment,
    scope: Scope,
    template: str,
    context: dict[str, Any],
    *,
    status: int = 200,
    headers: dict[str, str] | None = None,
) -> Response:
    """The rendered page; any lone surrogate that slipped past `shown` becomes U+FFFD instead
    of failing the response."""
    now = context.get("now") or datetime.now(UTC)
    state = scope.get("app") and getattr(scope["app"], "state", None)
    settings = getattr(state, "dashboard", None) if state is not None else None
    full = {
        "nav": "",
        "base": dashboard_root(scope),
        "path": route_path(scope),
        "now": now,
        "ago": lambda value: page_text.ago(value, now),
        "refresh_seconds": REFRESH_SECONDS,
        "login_required": bool(settings and settings.token),
        **context,
    }
    html = env.get_template(template).render(full)
    body = html.encode("utf-8", "replace")
    return Response(
        body,
        status_code=status,
        media_type=HTML,
        headers={"cache-control": "no-store", **(headers or {})},
    )


def error_page(
    env: Environment, request: Request | Scope, status: int, title: str, message: str
) -> Response:
    """An error page. `title` and `message` are escaped and cut here, unless they are already
    visible text (`page_text.Shown`, e.g. a message that quotes a request's value cut short)."""
    scope = request.scope if isinstance(request, Request) else request
    return page(
        env,
        scope,
        "error.html",
        {
            "title": _visible(title, ERROR_TITLE_CHARS),
            "message": _visible(message, ERROR_MESSAGE_CHARS),
            "status": status,
        },
        status=status,
    )


ERROR_TITLE_CHARS: Final = 200
ERROR_MESSAGE_CHARS: Final = 2000


def _visible(value: str, limit: int) -> page_text.Shown:
    return (
        page_text.cut(value, limit)
        if isinstance(value, page_text.Shown)
        else page_text.shown(value, limit)
    )
