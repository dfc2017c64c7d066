"""Storing answers while the run goes on: every lane's journal writer is flushed every `flush_interval_s`, and
at once when rows pile up faster than that.

A journal that cannot be written stops the run: answers that cannot be stored must not be bought. The flush
loop is told to stop, never cancelled: a cancel inside a write would put rows that its writer thread still
writes back in the buffer (written twice), or read as a journal failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lanes import Lane

BACKLOG_ROWS = 50_000  # rows waiting in the writers that the dispatcher flushes itself, between timed flushes


async def flush_all(lanes: Sequence[Lane]) -> None:
    for lane in lanes:
        await lane.writer.flush()


class JournalFlusher:
    """The timed flush of one run's lanes, and the error that stopped it, if any."""

    def __init__(self, interval_s: float, on_failure: Callable[[], None]):
        self.interval_s = interval_s
        self.error: BaseException | None = None
        self._on_failure = on_failure  # stops the run
        self._closing = asyncio.Event()  # the loop ends after the flush it is in, never inside one

    async def loop(self, lanes: Sequence[Lane]) -> None:
        while not self._closing.is_set():
            try:
                await asyncio.wait_for(self._closing.wait(), self.interval_s)
                return  # closing: the run's final flush follows
            except TimeoutError:
                pass
            try:
                await flush_all(lanes)
            except BaseException as e:
                self.error = e
                self._on_failure()
                raise

    def close(self) -> None:
        self._closing.set()

    def check(self, task: asyncio.Task) -> None:
        """After dispatch: a flush loop that ended by itself failed, whatever it raised."""
        if task.done() and self.error is None:
            self.error = task.exception() or RuntimeError("the journal writer stopped")

    @staticmethod
    async def flush_backlog(lanes: Sequence[Lane]) -> None:
        if sum(lane.writer.pending for lane in lanes) >= BACKLOG_ROWS:
            await flush_all(lanes)
