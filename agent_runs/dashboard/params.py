"""Query parameters of the pages, checked before any SQL: a bad one is a 400 naming it.

The names are the CLI's (`agent-runs runs`): status (repeatable), agent_slug, thread, uid,
worker, since, stuck, stuck_after, limit, before. An empty value means "not set" (an HTML form
submits its empty fields).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final
from urllib.parse import urlencode

from starlette.datastructures import QueryParams

from agent_runs import validation as check
from agent_runs.dashboard.page_text import Shown, shown
from agent_runs.durations import parse_duration, parse_since
from agent_runs.errors import InvalidArgument
from agent_runs.models import AttemptOutcome, RunStatus
from agent_runs.repository.operator_queries import DEFAULT_STUCK_AFTER, MAX_LIST_LIMIT

RUNS_PARAMS: Final = (
    "status",
    "agent_slug",
    "thread",
    "uid",
    "worker",
    "since",
    "stuck",
    "stuck_after",
    "limit",
    "before",
    "error_type",
    "finished",
    "outcome",
    "attempt_error_type",
    "scheduled",
)
# The window of the filters that read runs by when they finished, when only error_type is given.
DEFAULT_FINISHED: Final = "1d"
DEFAULT_LIMIT: Final = 50
OUTCOMES: Final = tuple(o.value for o in AttemptOutcome)
_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"", "0", "false", "no", "off"})
_MAX_PARAM_CHARS: Final = 1024
# A parameter's name as echoed on its 400 page, and the longest message there.
NAME_CHARS: Final = 64
MESSAGE_CHARS: Final = 2000
UNKNOWN_NAMED: Final = 5


class BadParameter(Exception):
    """A query parameter the page refuses: shown as a 400 page that names it.

    The name and message come from the request: `title` and `message` are them as visible text
    (escaped and cut as the CLI shows values), ready for the page."""

    def __init__(self, name: str, message: str | Shown) -> None:
        super().__init__(message)
        self.name = name
        self.title = Shown(f"Bad parameter: {shown(name, NAME_CHARS)}")
        self.message = message if isinstance(message, Shown) else shown(message, MESSAGE_CHARS)


@dataclass(frozen=True, slots=True)
class RunsQuery:
    """The /runs filters, as given (for the form and links) and as list_runs takes them."""

    statuses: tuple[str, ...] = ()
    agent_slug: str = ""
    thread: str = ""
    uid: str = ""
    worker: str = ""
    since: str = ""
    stuck: bool = False
    stuck_after: str = ""
    limit: int = DEFAULT_LIMIT
    before: str = ""
    error_type: str = ""
    finished: str = ""
    outcomes: tuple[str, ...] = ()  # repeatable: any of them
    attempt_error_type: str = ""
    scheduled: bool = False  # pending runs not available yet, the soonest first

    @property
    def by_attempt(self) -> bool:
        """Runs with an attempt finished in a window (outcome or attempt_error_type given, or
        a worker identity with a window): the workers page's counts."""
        return bool(self.outcomes or self.attempt_error_type or (self.worker and self.finished))

    @property
    def by_finish(self) -> bool:
        """Runs finished in a window, the latest first (error_type or finished given)."""
        return not self.by_attempt and bool(self.error_type or self.finished)

    def active_names(self) -> list[str]:
        """The filters set (limit and the page cursor aside), by name."""
        values = {
            "status": self.statuses,
            "agent_slug": self.agent_slug,
            "thread": self.thread,
            "uid": self.uid,
            "worker": self.worker,
            "since": self.since,
            "stuck": self.stuck,
            "stuck_after": self.stuck_after,
            "error_type": self.error_type,
            "finished": self.finished,
            "outcome": self.outcomes,
            "attempt_error_type": self.attempt_error_type,
            "scheduled": self.scheduled,
        }
        return [name for name, value in values.items() if value]

    def finished_window(self) -> timedelta:
        text = self.finished or DEFAULT_FINISHED
        window: timedelta = _checked("finished", lambda: parse_duration("finished", text))
        return window

    def filters(self) -> dict[str, Any]:
        """Keyword arguments of list_runs / list_run_listings."""
        since: datetime | timedelta | None = None
        if self.since:
            since = _checked("since", lambda: parse_since("since", self.since))
        stuck_after = DEFAULT_STUCK_AFTER
        if self.stuck_after:
            stuck_after = _checked(
                "stuck_after", lambda: parse_duration("stuck_after", self.stuck_after)
            )
        return {
            "statuses": list(self.statuses) or None,
            "agent_slug": self.agent_slug or None,
            "thread_id": self.thread or None,
            "uid": self.uid or None,
            "worker": self.worker or None,
            "since": since,
            "stuck": self.stuck,
            "stuck_after": stuck_after,
            "limit": self.limit,
            "before": self.before or None,
        }

    def link(self, **changes: Any) -> str:
        """This view's query string with `changes` (None removes a parameter)."""
        values: dict[str, Any] = {
            "status": list(self.statuses),
            "agent_slug": self.agent_slug,
            "thread": self.thread,
            "uid": self.uid,
            "worker": self.worker,
            "since": self.since,
            "stuck": "1" if self.stuck else "",
            "stuck_after": self.stuck_after,
            "limit": "" if self.limit == DEFAULT_LIMIT else str(self.limit),
            "before": self.before,
            "error_type": self.error_type,
            "finished": self.finished,
            "outcome": list(self.outcomes),
            "attempt_error_type": self.attempt_error_type,
            "scheduled": "1" if self.scheduled else "",
        }
        values.update({k: ("" if v is None else v) for k, v in changes.items()})
        pairs: list[tuple[str, str]] = []
        for name, value in values.items():
            for item in value if isinstance(value, list) else [value]:
                if item != "":
                    pairs.append((name, str(item)))
        return urlencode(pairs)


def _checked(name: str, parse: Any) -> Any:
    try:
        return parse()
    except InvalidArgument as exc:
        raise BadParameter(name, str(exc)) from None


def only(params: QueryParams, allowed: Iterable[str]) -> None:
    """Refuse any parameter the page does not know (a typo would silently show everything);
    the 400 names every unknown one (the first UNKNOWN_NAMED of them)."""
    known = set(allowed)
    unknown = list(dict.fromkeys(name for name in params if name not in known))
    if unknown:
        named = ", ".join(shown(name, NAME_CHARS) for name in unknown[:UNKNOWN_NAMED])
        more = f" and {len(unknown) - UNKNOWN_NAMED} more" if len(unknown) > UNKNOWN_NAMED else ""
        word = "parameter" if len(unknown) == 1 else "parameters"
        raise BadParameter(unknown[0], Shown(f"unknown query {word} {named}{more}"))
    for name in params:
        for value in params.getlist(name):
            if len(value) > _MAX_PARAM_CHARS:
                raise BadParameter(name, f"{name} must be at most {_MAX_PARAM_CHARS} characters")


def single(params: QueryParams, name: str) -> str:
    values = params.getlist(name)
    if len(values) > 1:
        raise BadParameter(name, f"{name} must be given at most once")
    return values[0].strip() if values else ""


def runs_query(params: QueryParams) -> RunsQuery:
    only(params, RUNS_PARAMS)
    statuses: list[str] = []
    for value in params.getlist("status"):
        if not value:
            continue
        try:
            statuses.append(RunStatus(value).value)
        except ValueError:
            choices = ", ".join(s.value for s in RunStatus)
            raise BadParameter("status", f"status must be one of {choices}") from None
    texts = {
        name: single(params, name)
        for name in (
            "agent_slug",
            "thread",
            "uid",
            "worker",
            "error_type",
            "finished",
            "attempt_error_type",
        )
    }
    for name, value in texts.items():
        if value:
            if name == "worker":
                _checked(name, lambda n=name, v=value: check.worker_id(v, n))
            elif name == "finished":
                _checked(name, lambda v=value: parse_duration("finished", v))
            else:
                _checked(name, lambda n=name, v=value: check.identifier(n, v))
    outcomes = [value for value in params.getlist("outcome") if value]
    for value in outcomes:
        if value not in OUTCOMES:
            raise BadParameter("outcome", f"outcome must be one of {', '.join(OUTCOMES)}")
    stuck_text = single(params, "stuck").lower()
    if stuck_text not in _TRUE | _FALSE:
        raise BadParameter("stuck", "stuck must be 1 or 0 (on or off)")
    scheduled_text = single(params, "scheduled").lower()
    if scheduled_text not in _TRUE | _FALSE:
        raise BadParameter("scheduled", "scheduled must be 1 or 0 (on or off)")
    limit_text = single(params, "limit")
    limit = DEFAULT_LIMIT
    if limit_text:
        if (
            not (limit_text.isascii() and limit_text.isdigit())
            or not 1 <= int(limit_text) <= MAX_LIST_LIMIT
        ):
            raise BadParameter("limit", f"limit must be an integer from 1 to {MAX_LIST_LIMIT}")
        limit = int(limit_text)
    query = RunsQuery(
        statuses=tuple(dict.fromkeys(statuses)),
        outcomes=tuple(dict.fromkeys(outcomes)),
        stuck=stuck_text in _TRUE,
        scheduled=scheduled_text in _TRUE,
        limit=limit,
        since=single(params, "since"),
        stuck_after=single(params, "stuck_after"),
        before=single(params, "before"),
        **texts,
    )
    query.filters()  # since and stuck_after parse here, before any SQL
    if query.scheduled:
        for name in (n for n in query.active_names() if n not in ("scheduled", "agent_slug")):
            raise BadParameter(name, f"{name} cannot be combined with scheduled")
    if query.by_attempt:
        given_here = {
            "status": query.statuses,
            "agent_slug": query.agent_slug,
            "thread": query.thread,
            "uid": query.uid,
            "since": query.since,
            "stuck": query.stuck,
            "stuck_after": query.stuck_after,
            "error_type": query.error_type,
        }
        _refuse_any(
            given_here,
            "outcome, attempt_error_type or worker with finished (runs by their attempts)",
        )
    if query.by_finish:
        given = {
            "worker": query.worker,
            "since": query.since,
            "stuck": query.stuck,
            "stuck_after": query.stuck_after,
        }
        _refuse_any(given, "error_type or finished (runs by finish)")
    return query


def _refuse_any(given: dict[str, object], others: str) -> None:
    """A 400 naming the first filter of `given` that is set: it cannot go with `others`."""
    for name, value in given.items():
        if value:
            raise BadParameter(name, f"{name} cannot be combined with {others}")
