"""The dispatch ledger: one line per attempt, written before the request is sent.

A kill -9 loses the requests in flight and the answers not yet flushed, but the provider bills them all the
same. The ledger is how a resumed run knows: each attempt appends `d <id>` before it goes out and `e <id>`
when it ended without a bill (an error, a refusal). An id whose last line is `d` and whose run stored no
answer for it was bought and lost; the next run charges it to the budget at the expected length of an answer
(`lost/` in the journal), so a crash never lets a dataset spend past its budget. Appends are unbuffered
`write(2)` calls of a few bytes: they survive the death of the process (not of the machine) and cost
microseconds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import polars as pl

LOST_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String(),
    "run_id": pl.String(),
    "estimated_tokens": pl.Float64(),
    "estimated_usd": pl.Float64(),
    "created_at": pl.Float64(),
}


class DispatchLedger:
    def __init__(self, folder: Path, run_id: str):
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / f"dispatch-{run_id}.log"
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def sent(self, request_id: str) -> None:
        os.write(self._fd, b"d\t" + request_id.encode() + b"\n")

    def unbilled(self, request_id: str) -> None:
        os.write(self._fd, b"e\t" + request_id.encode() + b"\n")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def bought_and_unstored(path: Path, stored: Callable[[str], set[str]]) -> tuple[str, list[str]]:
    """(run id, ids whose last attempt may have been billed and whose answer that run did not store)."""
    run_id = path.stem.removeprefix("dispatch-")
    last: dict[str, bytes] = {}
    for line in path.read_bytes().splitlines():
        kind, _, rid = line.partition(b"\t")
        if rid and kind in (b"d", b"e"):  # anything else is damage (a cut or foreign line): not an attempt
            last[rid.decode(errors="replace")] = kind
    open_ids = {rid for rid, kind in last.items() if kind == b"d"}
    return run_id, sorted(open_ids - stored(run_id)) if open_ids else []


def lost_rows(run_id: str, ids: list[str], tokens_each: float, usd_each: float) -> pl.DataFrame:
    n = len(ids)
    return pl.DataFrame(
        {
            "id": ids,
            "run_id": [run_id] * n,
            "estimated_tokens": [tokens_each] * n,
            "estimated_usd": [usd_each] * n,
            "created_at": [time.time()] * n,
        },
        schema=LOST_SCHEMA,
    )
