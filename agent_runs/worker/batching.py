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
    __slots__ = ("answer", "done", "error", "item", "turn", "wake")

    def __init__(self, item: I) -> None:
        self.item = item
        self.answer: O | None = None
        self.error: BaseException | None = None
        self.done = False
        self.turn = False  # its thread writes the next batch (set under the group's lock)
        # Held from the start; released once to wake the waiting thread.
        self.wake = threading.Lock()
        self.wake.acquire()


class GroupCommit(Generic[I, O]):
    """Batches concurrent `submit` calls into calls of `write(items) -> answers` (same order)."""

    def __init__(self, write: Callable[[list[I]], Sequence[O]], *, max_batch: int) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, got {max_batch}")
        self._write = write
        self._max_batch = max_batch
        self._lock = threading.Lock()
        self._waiting: list[_Slot[I, O]] = []  # neither in a batch nor holding the turn
        self._writing = False  # a thread holds the turn
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
            waits = self._writing
            if waits:
                self._waiting.append(slot)
            else:
                self._writing = slot.turn = True
        try:
            if waits:
                slot.wake.acquire()  # its batch was written, or the turn was handed to it
            if not slot.done:
                self._write_batch(slot)
        except BaseException:
            # Interrupted (Ctrl-C in the main thread, an asynchronous exception): a turn it
            # holds goes on to the next thread, or every later submit would wait forever.
            self._withdraw(slot)
            raise
        if slot.error is not None:
            raise slot.error
        return slot.answer  # type: ignore[return-value]  # set with done, unless error is

    def _write_batch(self, mine: _Slot[I, O]) -> None:
        """Write `mine` (holding the turn) and the oldest waiting items, then hand the turn on."""
        batch = [mine]
        try:
            with self._lock:
                batch += self._waiting[: self._max_batch - 1]
                del self._waiting[: self._max_batch - 1]
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
                mine.turn = False
                following = self._hand_turn()
            if following is not None:
                following.wake.release()  # the next batch first: its thread writes it
            for slot in batch:
                if slot is not mine:
                    slot.wake.release()

    def _withdraw(self, slot: _Slot[I, O]) -> None:
        """An interrupted submit: out of the queue, and its turn (if it holds it) handed on."""
        with self._lock:
            following = None
            if slot in self._waiting:
                self._waiting.remove(slot)
            elif slot.turn:
                slot.turn = False
                following = self._hand_turn()
        if following is not None:
            following.wake.release()

    def _hand_turn(self) -> _Slot[I, O] | None:
        """The oldest waiting slot, now holding the turn; None (no writer) when none waits.
        The caller holds the lock, and wakes the slot after releasing it."""
        if not self._waiting:
            self._writing = False
            return None
        following = self._waiting.pop(0)
        following.turn = True
        return following
