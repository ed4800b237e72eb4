"""Result rows read by column name: a shape per result (made once per column list), a row a
tuple."""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import psycopg


@dataclass(frozen=True, slots=True)
class Shape:
    """The columns of one statement's result, by name."""

    index: Mapping[str, int]
    _pickers: dict[str, Callable[[Sequence[Any]], tuple[Any, ...]] | None] = field(
        default_factory=dict, compare=False
    )

    def picker(
        self, key: str, wanted: tuple[str, ...]
    ) -> Callable[[Sequence[Any]], tuple[Any, ...]] | None:
        """A function taking the `wanted` columns, in that order, out of a row (None if one is
        missing); made once per shape and `key`."""
        try:
            return self._pickers[key]
        except KeyError:
            index = self.index
            found = None
            if all(n in index for n in wanted):
                positions = [index[n] for n in wanted]
                getter = operator.itemgetter(*positions)
                found = getter if len(positions) > 1 else lambda row: (getter(row),)
            self._pickers[key] = found
            return found


@lru_cache(maxsize=128)
def shape(names: tuple[str, ...]) -> Shape:
    index: dict[str, int] = {}
    for position, name in enumerate(names):
        index.setdefault(name, position)
    return Shape(index=index)


class Row:
    """One result row: its values as a tuple, read by column name through the result's shape."""

    __slots__ = ("shape", "values")

    def __init__(self, shape: Shape, values: Sequence[Any]) -> None:
        self.shape = shape
        self.values = values

    def __getitem__(self, name: str) -> Any:
        return self.values[self.shape.index[name]]


def shape_of(cur: psycopg.Cursor[Any]) -> Shape:
    """The shape of a classic cursor's current result."""
    return shape(tuple(column.name for column in cur.description or ()))


def rows_of(cur: psycopg.Cursor[Any]) -> list[Row]:
    """The rows of a classic cursor's current result."""
    rows = cur.fetchall()  # first: in the caller's pipeline, only fetching syncs the result
    found = shape_of(cur)
    return [Row(found, values) for values in rows]
