"""Plans: what a repository call does, as data that both faces (sync and asyncio) carry out.

A plan is a generator (psycopg's own generators pattern): it validates its arguments, yields
the statements it needs, receives their rows and returns the call's value. It holds every rule
of the call (the checks, the parameters, the sql/ file, how the answer reads, which database
error means what); a face only knows how to run a statement. `AgentRunRepository` and
`agent_runs.aio.AsyncAgentRunRepository` drive the same plans, so a rule exists once.

- `Execute(statement(name), params)`: run sql/<name>.sql and send back its rows. At the top
  of a call it runs in a transaction of its own (a savepoint inside the caller's); inside a
  `Transaction` step it is one more statement of that transaction. A database error is thrown
  into the plan at its `yield` (after the transaction or savepoint rolled back), so the plan
  can map it.
- `Transaction(plan)`: run a sub-plan inside one explicit transaction; send back its value.
- `Emit(value)`: a stream's next item (`prune_batches`): the face hands it to its caller.

A repository method is written as its plan and decorated `@planned`: the synchronous face
drives it in place (agent_runs.driver); the asyncio face takes the same plan (`plan_of`) and
awaits it (agent_runs.aio.driver).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    ParamSpec,
    TypeAlias,
    TypeVar,
)

if TYPE_CHECKING:
    from agent_runs.transport import Statement

_T = TypeVar("_T")
_Y = TypeVar("_Y")
_R = TypeVar("_R")
_P = ParamSpec("_P")
_F = TypeVar("_F", bound=Callable[..., Any])


class Execute:
    """Run `stmt` (agent_runs.transport.statement("<name of the sql/ file>")) with `params`.
    (A plain class: made on every call, it is the cheapest to make.)"""

    __slots__ = ("params", "stmt")

    def __init__(self, stmt: Statement, params: Mapping[str, Any]) -> None:
        self.stmt = stmt
        self.params = params


@dataclass(frozen=True, slots=True)
class Transaction:
    plan: Plan[Any]


@dataclass(frozen=True, slots=True)
class Emit(Generic[_T]):
    value: _T


Step: TypeAlias = Execute | Transaction
# A call: yields steps, receives each one's answer (rows, or a sub-plan's value), returns T.
Plan: TypeAlias = Generator[Step, Any, _T]
# A call that hands out items as it goes (each step its own transaction, between the items).
Stream: TypeAlias = Generator[Step | Emit[_T], Any, None]


class Failed:
    """A step's database error, to be thrown into the plan at its yield."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


@dataclass(frozen=True, slots=True)
class Done(Generic[_T]):
    value: _T


def next_step(plan: Generator[_Y, Any, Any], answer: object) -> _Y:
    """Send a step's answer (or throw its `Failed` error) into a plan or stream: what it yields
    next. Raises StopIteration, carrying the plan's value, when it is done. Start it with
    answer None."""
    if type(answer) is Failed:
        return plan.throw(answer.error)
    return plan.send(answer)


def pull(stream: Stream[_T]) -> Plan[Emit[_T] | Done[None]]:
    """A plan that takes a stream to its next item: its steps are the stream's, its value the
    item (`Emit`), or `Done` once the stream ends. A face drives one pull per item, so it holds
    the connection for a batch at a time, never between items."""
    answer: object = None
    while True:
        try:
            item = next_step(stream, answer)
        except StopIteration:
            return Done(None)
        if isinstance(item, Emit):
            return item
        try:
            answer = yield item
        except Exception as exc:  # the step's database error: the stream's to handle
            answer = Failed(exc)


def as_method(plan: Callable[..., Any], method: _F) -> _F:
    """`method` dressed as the plan it drives: the plan's name, docstring and signature (its
    return annotation left out: the face decides what a call answers), for help() and
    inspect."""
    functools.update_wrapper(method, plan)
    signature = inspect.signature(plan)
    method.__signature__ = signature.replace(  # type: ignore[attr-defined]
        return_annotation=inspect.Signature.empty
    )
    return method


def planned(plan: Callable[Concatenate[Any, _P], Plan[_T]]) -> Callable[Concatenate[Any, _P], _T]:
    """Decorator: a repository method written as its plan (`def m(self, ...) -> Plan[T]`)
    becomes a method that has its face drive the plan (`face._drive`) and answers what the face
    answers: the value (an awaitable of it on the asyncio face, see `plan_of`). A plan never
    relies on `self` being one face or the other: `self` only leads it to other plans."""

    def method(face: Any, /, *args: Any, **kwargs: Any) -> Any:
        return face._drive(plan(face, *args, **kwargs))

    method.plan = plan  # type: ignore[attr-defined]
    return as_method(plan, method)


def planned_stream(
    plan: Callable[Concatenate[Any, _P], Stream[_T]],
) -> Callable[Concatenate[Any, _P], Iterator[_T]]:
    """Decorator: a method written as a stream; the face's `_iterate` hands out its items."""

    def method(face: Any, /, *args: Any, **kwargs: Any) -> Any:
        return face._iterate(plan(face, *args, **kwargs))

    method.plan = plan  # type: ignore[attr-defined]
    return as_method(plan, method)


def plan_of(method: Callable[Concatenate[Any, _P], _R]) -> Callable[Concatenate[Any, _P], Any]:
    """The plan a `planned` (or `planned_stream`) method drives, for another face to drive."""
    plan: Callable[Concatenate[Any, _P], Any] = vars(method)["plan"]
    return plan
