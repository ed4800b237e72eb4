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
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Generator, Iterator, Mapping
from dataclasses import dataclass
from types import MethodType
from typing import (
    TYPE_CHECKING,
    Any,
    Concatenate,
    Generic,
    ParamSpec,
    Self,
    TypeAlias,
    TypeVar,
    overload,
)

if TYPE_CHECKING:
    from agent_runs.transport import Statement

_T = TypeVar("_T")
_Y = TypeVar("_Y")
_R = TypeVar("_R")
_P = ParamSpec("_P")
_F = TypeVar("_F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True)
class Execute:
    stmt: Statement  # agent_runs.transport.statement("<name of the sql/ file>")
    params: Mapping[str, Any]


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


@dataclass(frozen=True, slots=True)
class Failed:
    """A step's database error, to be thrown into the plan at its yield."""

    error: BaseException


@dataclass(frozen=True, slots=True)
class Done(Generic[_T]):
    value: _T


def advance(plan: Generator[_Y, Any, _T], answer: object) -> _Y | Done[_T]:
    """Send a step's answer (or throw its `Failed` error) into a plan or stream: what it
    yields next, or `Done` with its value. Start it with answer None."""
    try:
        if isinstance(answer, Failed):
            return plan.throw(answer.error)
        return plan.send(answer)
    except StopIteration as stop:
        return Done(stop.value)


def pull(stream: Stream[_T]) -> Plan[Emit[_T] | Done[None]]:
    """A plan that takes a stream to its next item: its steps are the stream's, its value the
    item (`Emit`), or `Done` once the stream ends. A face drives one pull per item, so it holds
    the connection for a batch at a time, never between items."""
    answer: object = None
    while True:
        item = advance(stream, answer)
        if isinstance(item, Emit | Done):
            return item
        try:
            answer = yield item
        except Exception as exc:  # the step's database error: the stream's to handle
            answer = Failed(exc)


def as_method(plan: Callable[..., Any], method: _F, *, add_self: bool = False) -> _F:
    """`method` dressed as the plan it drives: the plan's name, docstring and signature (with
    `self` put in front when the plan has none), for help() and inspect."""
    functools.update_wrapper(method, plan)
    signature = inspect.signature(plan)
    parameters = list(signature.parameters.values())
    if add_self:
        parameters.insert(0, inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY))
    method.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=parameters, return_annotation=inspect.Signature.empty
    )
    return method


class Planned(Generic[_P, _R]):
    """A repository method written as its plan (`def m(self, ...) -> Plan[T]`), as a method
    of a face: `method(face, *args)` drives the plan made by `plan(face, *args)` on that face
    and answers what the face answers (the value; an awaitable of it on the asyncio face).
    The plan stays reachable as `.plan` (`AgentRunRepository.get_run.plan`), so the asyncio
    face drives the very same plans. A plan never relies on `self` being one face or the
    other: `self` only leads it to the other plans."""

    def __init__(self, plan: Callable[Concatenate[Any, _P], Any], method: Callable[..., _R]):
        self.plan = plan
        self._method = as_method(plan, method)
        functools.update_wrapper(self, plan)

    @overload
    def __get__(self, obj: None, owner: type[Any]) -> Self: ...
    @overload
    def __get__(self, obj: object, owner: type[Any]) -> Callable[_P, _R]: ...
    def __get__(self, obj: object, owner: type[Any]) -> Self | Callable[_P, _R]:
        if obj is None:
            return self
        return MethodType(self._method, obj)

    def __call__(self, face: Any, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        """On the class, the method as a plain function: `AgentRunRepository.get_run(repo, id)`."""
        return self._method(face, *args, **kwargs)


def planned(plan: Callable[Concatenate[Any, _P], Plan[_T]]) -> Planned[_P, _T]:
    """Decorator: a method written as its plan; the face's `_drive` carries it out."""

    def method(face: Any, /, *args: Any, **kwargs: Any) -> Any:
        return face._drive(plan(face, *args, **kwargs))

    return Planned(plan, method)


def planned_stream(plan: Callable[Concatenate[Any, _P], Stream[_T]]) -> Planned[_P, Iterator[_T]]:
    """Decorator: a method written as a stream; the face's `_iterate` hands out its items."""

    def method(face: Any, /, *args: Any, **kwargs: Any) -> Any:
        return face._iterate(plan(face, *args, **kwargs))

    return Planned(plan, method)
