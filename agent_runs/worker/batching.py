"""Group commit: threads that need the same kind of write at the same time share one statement.

A thread calls `submit(item)`. If no batch is being written, it writes at once every item that
is waiting (its own included) with one call of `write`; threads that submit meanwhile wait, and
the first of them writes the next batch when this one returns. Alone, a thread writes its own
item with no added wait; under load, batches grow with the number of waiting threads. Each
thread gets its own item's answer, or the exception the batch raised.

Each waiting thread is woken once, by its own lock: when its batch was written, or when its
turn to write the next batch came. (A shared condition woke every waiting thread after every
batch, most of them only to wait again: with 16 threads that cost more of the process's time
than the statements it was waiting for.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

import psycopg

I = TypeVar("I")  # noqa: E741 - the item type
O = TypeVar("O")  # noqa: E741 - the answer type


class _Slot(Generic[I, O]):
    __slots__ = ("answer", "done", "error", "item", "wake")

    def __init__(self, item: I) -> None:
        self.item = item
        self.answer: O | None = None
        self.error: BaseException | None = None
        self.done = False
        # Held from the start; released once to wake the waiting thread.
        self.wake = threading.Lock()
        self.wake.acquire()


class GroupCommit(Generic[I, O]):
    """Batches concurrent `submit` calls into calls of `write(items) -> answers` (same order)."""

    def __init__(self, write: Callable[[list[I]], Sequence[O]], *, max_batch: int) -> None:
        self._write = write
        self._max_batch = max_batch
        self._lock = threading.Lock()
        self._waiting: list[_Slot[I, O]] = []
        self._writing = False
        self.batches = 0  # batches written, for tests and logs
        self.items = 0

    @property
    def waiting(self) -> int:
        """Items submitted and not yet taken into a batch."""
        with self._lock:
            return len(self._waiting)

    def submit(self, item: I) -> O:
        """Write `item` in a batch; its answer, or the exception its batch raised."""
        slot: _Slot[I, O] = _Slot(item)
        with self._lock:
            self._waiting.append(slot)
            waits, self._writing = self._writing, True
        if waits:
            slot.wake.acquire()  # its batch was written, or it writes the next one
        if not slot.done:
            # The writer's own item heads the queue (it found no writer, or was handed the
            # turn as the oldest waiting), so it is always in the batch it writes.
            self._write_batch(slot)
        if slot.error is not None:
            raise slot.error
        return slot.answer  # type: ignore[return-value]  # set with done, unless error is

    def _write_batch(self, mine: _Slot[I, O]) -> None:
        with self._lock:
            batch = self._waiting[: self._max_batch]
            del self._waiting[: self._max_batch]
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
        finally:
            with self._lock:
                for slot in batch:
                    slot.done = True
                self.batches += 1
                self.items += len(batch)
                following = self._waiting[0] if self._waiting else None
                self._writing = following is not None
            if following is not None:
                following.wake.release()  # the next batch first: its thread writes it
            for slot in batch:
                if slot is not mine:
                    slot.wake.release()
