"""Storing answers while the run goes on: every lane's journal writer is flushed every `flush_interval_s`, and
at once when rows pile up faster than that.

A journal that cannot be written stops the run: answers that cannot be stored must not be bought. The flush
loop is told to stop, never cancelled: a cancel inside a write would put rows that its writer thread still
writes back in the buffer (written twice), or read as a journal failure.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lanes import Lane

BACKLOG_ROWS = 50_000  # rows waiting in the writers that the dispatcher flushes itself, between timed flushes
MIB = 1 << 20


class StorageRoom:
    """Whether the filesystem a lane's journal is written to has room for what is at stake: the answers in
    flight and those waiting for the next flush, at the bytes a stored answer takes, twice over (the run's
    parts are folded into one file at its end), plus a fixed margin.

    A full disk must stop the buying before it fails a write: an answer bought and not stored is paid for and
    bought again by the next run. Checked at most every `interval_s` (one `statvfs`)."""

    def __init__(self, folder: Path, row_bytes: float, margin_bytes: int = MIB, interval_s: float = 0.1):
        self.folder = folder
        self.row_bytes = max(row_bytes, 1.0)  # until this run has written some: what earlier rows took
        self.margin_bytes = margin_bytes
        self.interval_s = interval_s
        self._next = 0.0

    def needed(self, rows_at_stake: int, written: tuple[int, int] = (0, 0)) -> int:
        """Bytes to keep free for `rows_at_stake`, at the size of the rows this run wrote (`written`: rows,
        bytes) where it wrote any."""
        rows, size = written
        per_row = size / rows if rows else self.row_bytes
        return int(2 * per_row * max(rows_at_stake, 1)) + self.margin_bytes

    def problem(self, now: float, rows_at_stake: int, written: tuple[int, int] = (0, 0)) -> str | None:
        """Why nothing more may be bought (the room left is under what is at stake); None when there is room
        or the last look was less than `interval_s` ago."""
        if now < self._next:
            return None
        self._next = now + self.interval_s
        try:
            st = os.statvfs(self.folder)
        except OSError as e:
            return f"cannot tell the free space under {self.folder}: {e}"
        free = st.f_bavail * st.f_frsize
        need = self.needed(rows_at_stake, written)
        if free >= need:
            return None
        return (
            f"the filesystem of {self.folder} has {free / MIB:,.2f} MiB free, under the {need / MIB:,.2f} "
            f"MiB that the {rows_at_stake:,} answers in flight or waiting to be written may take: nothing "
            "more is sent (every answer already received is stored). Free space there or move "
            "storage.root, then materialise again"
        )


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
