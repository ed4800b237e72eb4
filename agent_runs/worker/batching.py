"""Group commit: threads that need the same kind of write at the same time share one statement.

A thread calls `submit(item)`. If no batch is being written, it writes at once every item that
is waiting (its own included) with one call of `write`; threads that submit meanwhile wait, and
the first of them writes the next batch when this one returns. Alone, a thread writes its own
item with no added wait; under load, batches grow with the number of waiting threads. Each
thread gets its own item's answer, or the exception the batch raised.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import psycopg

I = TypeVar("I")  # noqa: E741 - the item type
O = TypeVar("O")  # noqa: E741 - the answer type


class _Slot(Generic[I, O]):
    __slots__ = ("answer", "done", "error", "item")

    def __init__(self, item: I) -> None:
        self.item = item
        self.answer: O | None = None
        self.error: BaseException | None = None
        self.done = False


class GroupCommit(Generic[I, O]):
    """Batches concurrent `submit` calls into calls of `write(items) -> answers` (same order)."""

    def __init__(self, write: Callable[[list[I]], Sequence[O]], *, max_batch: int) -> None:
        self._write = write
        self._max_batch = max_batch
        self._changed = threading.Condition()
        self._waiting: list[_Slot[I, O]] = []
        self._writing = False
        self.batches = 0  # batches written, for tests and logs
        self.items = 0

    @property
    def waiting(self) -> int:
        """Items submitted and not yet taken into a batch."""
        with self._changed:
            return len(self._waiting)

    def submit(self, item: I) -> O:
        """Write `item` in a batch; its answer, or the exception its batch raised."""
        slot: _Slot[I, O] = _Slot(item)
        with self._changed:
            self._waiting.append(slot)
        while True:
            with self._changed:
                while not slot.done and self._writing:
                    self._changed.wait()
                if slot.done:
                    break
                batch = self._waiting[: self._max_batch]
                del self._waiting[: self._max_batch]
                self._writing = True
            self._write_batch(batch, slot)
        if slot.error is not None:
            raise slot.error
        return slot.answer  # type: ignore[return-value]  # set with done, unless error is

    def _write_batch(self, batch: list[_Slot[I, O]], mine: _Slot[I, O]) -> None:
        try:
            answers = self._write([slot.item for slot in batch])
            if len(answers) != len(batch):
                raise AssertionError(f"{len(batch)} items written, {len(answers)} answers")
            for slot, answer in zip(batch, answers, strict=True):
                slot.answer = answer
        except BaseException as exc:  # every waiting thread learns what happened to its item
            # An interrupt (KeyboardInterrupt, SystemExit) is the writer's own: the others only
            # learn that their batch's outcome is unknown, and take their in-doubt paths.
            shared = (
                exc
                if isinstance(exc, Exception)
                else psycopg.OperationalError("the batch's writer was interrupted: outcome unknown")
            )
            for slot in batch:
                slot.error = exc if slot is mine else shared
            if shared is not exc and mine not in batch:
                raise  # the writer's interrupt, though its own item waits for a later batch
        finally:
            with self._changed:
                for slot in batch:
                    slot.done = True
                self._writing = False
                self.batches += 1
                self.items += len(batch)
                self._changed.notify_all()
