"""Append-only Parquet tables in a folder: the journal of responses and failures.

Rows arrive as immutable part files, each written atomically, so a kill -9 can lose only rows not yet flushed
and can never leave a half-written file that a reader picks up. `compact()` folds the parts into one file with
one row per key; a crash inside it at worst leaves a duplicate that readers and the next compaction drop.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import polars as pl

from .files import remove_stale_temporaries, sink_parquet, write_json, write_parquet
from .quarantine import Quarantined, has_parquet_magic, parquet_problem, quarantine

Keep = Literal["first", "last", "any", "none"]  # which copy of a key wins

RESPONSE_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String(),
    "backend": pl.String(),
    "model": pl.String(),
    "provider": pl.String(),
    "content": pl.String(),
    "reasoning": pl.String(),
    "finish_reason": pl.String(),
    "prompt_tokens": pl.Int64(),
    "completion_tokens": pl.Int64(),
    "cost_usd": pl.Float64(),
    "output_ids": pl.List(pl.Int32()),
    "native_finish_reason": pl.String(),
    "reasoning_tokens": pl.Int64(),
    "cached_tokens": pl.Int64(),
    "request_id": pl.String(),
    "latency_s": pl.Float64(),
    "created_at": pl.Float64(),  # unix seconds
    "run_id": pl.String(),
    "source": pl.String(),  # "generated" or "imported:<file name>"
    # no usage from the server: completion_tokens counted with the target tokenizer
    "usage_estimated": pl.Boolean(),
    # What binds the answer to its request (core.generation.binding): the messages as sent, and the sampling,
    # template variables and backend knobs it was asked with. Null in rows written before they existed.
    "prompt_fingerprint": pl.String(),
    "settings_fingerprint": pl.String(),
    # completion_tokens is what the budget charged: the larger of these two, the provider's usage and this
    # platform's own count of what arrived (reasoning included).
    "reported_completion_tokens": pl.Int64(),
    "counted_completion_tokens": pl.Int64(),
    "quantization": pl.String(),  # where the provider says which quantization served it
    "cut_at_max_tokens": pl.Boolean(),  # the provider sent more than max_tokens: kept up to the limit
    # The answer's tool calls (core.target_model.tool_calls: compact JSON of id, name and the arguments' text
    # as the target wrote it); null for an answer without calls.
    "tool_calls": pl.String(),
}

# Answers set aside (set_aside/): kept with why, never trained, still charged to the budget. One row per
# answer set aside (`aside_key`: its id and when it was stored), so an answer set aside twice is one row.
SET_ASIDE_SCHEMA: dict[str, pl.DataType] = {
    **RESPONSE_SCHEMA,
    "aside_key": pl.String(),
    "aside_reason": pl.String(),
    "aside_detail": pl.String(),
    "set_aside_at": pl.Float64(),
}

FAILURE_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String(),
    "error_kind": pl.String(),
    "message": pl.String(),
    "attempts": pl.Int32(),
    "permanent": pl.Boolean(),
    "backend": pl.String(),
    "status": pl.Int32(),
    "created_at": pl.Float64(),
    "run_id": pl.String(),
}


# Rows `eagle3 import-responses` could not use (imports/*.parquet).
IMPORT_REJECTED_SCHEMA: dict[str, pl.DataType] = {"source_row": pl.Int64(), "reason": pl.String()}

TALLY = (
    "tally.json"  # beside a table's parts: rows and sums per part, what a part held once it cannot be read
)


class BusyError(RuntimeError):
    """Another process is writing this table (it would send the same prompts and pay twice)."""


class JournalTable:
    """A folder of Parquet parts with a key column; the union of the parts is the table."""

    def __init__(
        self,
        folder: Path,
        schema: dict[str, pl.DataType],
        key: str = "id",
        required: Sequence[str] | None = None,
        tally_file: Path | None = None,
        tally: Sequence[str] = (),
    ):
        self.folder = Path(folder)
        self.schema = schema
        self.key = key
        self.required = list(required) if required is not None else [key]  # a part without these is damaged
        # Rows per part, and the sums of the `tally` columns, kept in `tally_file` (a JSON outside the folder,
        # so the folder holds only parts). A part later found damaged can no longer say what it held; the
        # tally can (the answers to ask again, the tokens they cost).
        self.tally_file = Path(tally_file) if tally_file is not None else None
        self.tally_columns = list(tally)
        self._seq = 0
        self.written: list[str] = []  # part files this object appended (a run folds its own parts at the end)

    # -- reading --------------------------------------------------------------------------------------------
    def files(self) -> list[Path]:
        """The parts, without any that is cut short or not Parquet at all (the owning stage's `sweep` sets
        those aside; every other reader skips them rather than failing)."""
        return [p for p in self._all_files() if has_parquet_magic(p)]

    def _all_files(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.glob("*.parquet") if not p.name.startswith("."))

    def scan(self, columns: list[str] | None = None) -> pl.LazyFrame:
        files = self.files()
        if not files:
            return pl.DataFrame(schema=self.schema).lazy().select(columns or list(self.schema))
        frames = [self._conform(pl.scan_parquet(f)) for f in files]
        lf = pl.concat(frames, how="vertical_relaxed")
        return lf.select(columns) if columns else lf

    def _conform(self, lf: pl.LazyFrame) -> pl.LazyFrame:
        """Parts written by older versions may lack newer columns: add them as nulls."""
        have = lf.collect_schema()
        cols = [
            pl.col(name).cast(dtype) if name in have else pl.lit(None, dtype=dtype).alias(name)
            for name, dtype in self.schema.items()
        ]
        return lf.select(cols)

    def keys(self) -> set[str]:
        return set(self.scan([self.key]).collect()[self.key].to_list())

    def read(self, keep: Keep = "first") -> pl.DataFrame:
        """The table with one row per key (`keep`: which copy wins when a crash left two)."""
        return self.scan().unique(subset=[self.key], keep=keep, maintain_order=True).collect()

    # -- writing --------------------------------------------------------------------------------------------
    def append(self, rows: pl.DataFrame | dict[str, list[Any]]) -> Path | None:
        df = rows if isinstance(rows, pl.DataFrame) else pl.DataFrame(rows, schema=self.schema)
        if df.height == 0:
            return None
        self._seq += 1
        name = f"part-{time.time_ns():020d}-{os.getpid()}-{self._seq:06d}.parquet"
        path = write_parquet(df.select(list(self.schema)), self.folder / name)
        self.written.append(name)
        self._tally({name: self._tally_entry(df.lazy())}, prune=False)
        return path

    def compact(self, keep: Keep = "first", drop_keys: Iterable[str] | None = None) -> int:
        """Fold all parts into one file with one row per key; returns the row count. O(table): an occasional
        step.

        The new file is in place before the old parts go, so a crash in between duplicates rows, never loses
        them.
        """
        remove_stale_temporaries(self.folder)
        files = self.files()
        if not files:
            return 0
        lf = self.scan().unique(subset=[self.key], keep=keep, maintain_order=True)
        if drop_keys is not None:
            drop = pl.Series(self.key, list(drop_keys), dtype=pl.String)
            lf = lf.filter(~pl.col(self.key).is_in(drop.implode()))
        rows = lf.select(pl.len()).collect().item()
        if len(files) == 1 and rows == pl.scan_parquet(files[0]).select(pl.len()).collect().item():
            return rows
        new = sink_parquet(lf, self.folder / f"data-{time.time_ns():020d}.parquet") if rows else None
        for f in files:
            f.unlink(missing_ok=True)
        self._tally({new.name: self._tally_entry(pl.scan_parquet(new))} if new else {})
        return rows

    def fold(self, names: Iterable[str]) -> Path | None:
        """Fold the named parts (one run's) into one file: O(what they hold), never the whole table. A crash
        in between leaves both copies, which readers and a later compaction drop."""
        paths = [self.folder / n for n in names if (self.folder / n).exists()]
        if len(paths) < 2:
            return None
        frames = [self._conform(pl.scan_parquet(p)) for p in paths]
        merged = sink_parquet(
            pl.concat(frames, how="vertical_relaxed"), self.folder / f"run-{time.time_ns():020d}.parquet"
        )
        for p in paths:
            p.unlink(missing_ok=True)
        self._tally({merged.name: self._tally_entry(pl.scan_parquet(merged))})
        return merged

    # -- damage ---------------------------------------------------------------------------------------------
    def sweep(
        self,
        partition_dir: Path,
        stage: str,
        before_move: Callable[[str, dict[str, Any]], None] | None = None,
    ) -> list[Quarantined]:
        """Set aside every part that cannot be read as this table (cut short, not Parquet, wrong schema), each
        with what the tally knew it held. Parts this object wrote itself are whole (atomic writes) and
        skipped. `before_move(part name, tally entry)` runs before each move: a charge it records survives a
        crash in between (the part is then set aside, and charged, once more: never less)."""
        own = set(self.written)
        damaged = [
            (p, why)
            for p in self._all_files()
            if p.name not in own and (why := parquet_problem(p, self.schema, self.required)) is not None
        ]
        if not damaged:
            return []
        tally = self.read_tally()
        out = []
        for p, why in damaged:
            entry = tally.get(p.name) or {}
            if before_move is not None:
                before_move(str(p.relative_to(partition_dir)), entry)
            details = {"run_id": entry.get("run_id"), **entry.get("sums", {})} if entry else {}
            out.append(quarantine(partition_dir, p, why, stage, rows=entry.get("rows"), details=details))
        self._tally({})
        return out

    def fill_tally(self) -> int:
        """Tally the readable parts the tally does not know (written before it existed, or a tally that was
        lost): the small columns of those parts only, once. Returns how many were added."""
        if self.tally_file is None:
            return 0
        tally = self.read_tally()
        missing = [p for p in self.files() if p.name not in tally]
        if not missing:
            return 0
        self._tally({p.name: self._tally_entry(pl.scan_parquet(p)) for p in missing})
        return len(missing)

    def read_tally(self) -> dict[str, dict[str, Any]]:
        """Part name -> {rows, run_id, sums}: what each part held when it was written."""
        path = self.tally_file
        try:
            return json.loads(path.read_text()) if path is not None and path.exists() else {}
        except (OSError, ValueError):
            return {}  # a damaged tally only loses what damaged parts held; it is rewritten at the next write

    def _tally_entry(self, lf: pl.LazyFrame) -> dict[str, Any]:
        cols = self.tally_columns
        have = lf.collect_schema()
        exprs = [pl.len().alias("__rows")]
        exprs += [pl.col(c).cast(pl.Float64).sum().alias(c) for c in cols if c in have]
        if "run_id" in have:
            exprs.append(pl.col("run_id").unique().alias("__runs").implode())
        row = lf.select(exprs).collect().row(0, named=True)
        runs = [r for r in (row.get("__runs") or []) if r is not None]
        return {
            "rows": int(row["__rows"]),
            "run_id": runs[0] if len(runs) == 1 else None,
            "sums": {c: float(row[c] or 0.0) for c in cols if c in row},
        }

    def _tally(self, new: dict[str, dict[str, Any]], prune: bool = True) -> None:
        """Add `new` entries and (`prune`) drop those of parts that are gone; an append does not list the
        folder, the run's fold does. Best effort: it never fails a write."""
        if self.tally_file is None:
            return
        try:
            tally = self.read_tally()
            tally.update(new)
            if prune:
                names = {p.name for p in self._all_files()}
                tally = {k: v for k, v in tally.items() if k in names}
            write_json(dict(sorted(tally.items())), self.tally_file)
        except OSError:
            pass

    def row_count(self) -> tuple[int, int]:
        """(rows, distinct keys) from the key column alone."""
        counts = self.scan([self.key]).select(
            pl.len().alias("rows"), pl.col(self.key).n_unique().alias("keys")
        )
        row = counts.collect().row(0)
        return int(row[0]), int(row[1])

    @contextmanager
    def exclusive(self, what: str):
        """Hold an advisory lock for the duration of a run; the OS drops it if the process dies."""
        self.folder.mkdir(parents=True, exist_ok=True)
        lock_path = self.folder / ".lock"
        fh = open(lock_path, "a+")  # noqa: SIM115 (held across the yield, closed in finally)
        try:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.seek(0)
                holder = fh.read().strip() or "another process"
                fh.close()
                raise BusyError(
                    f"{what} is already running ({holder}); wait for it or stop it first"
                ) from None
            fh.seek(0)
            fh.truncate()
            fh.write(f"pid {os.getpid()} on {os.uname().nodename}")
            fh.flush()
            yield
        finally:
            if not fh.closed:
                fh.close()


def empty_columns(schema: dict[str, pl.DataType]) -> dict[str, list[Any]]:
    return {name: [] for name in schema}
