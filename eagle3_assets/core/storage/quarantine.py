"""Damaged files: found before a stage reads them, moved aside with their reason, never fatal.

The project's own writes are atomic, but a copy interrupted, a disk or an object store that loses a tail, or a
person who drops the wrong file into a folder can leave a file no reader can open, and such a file would fail
every run of its partition until someone deleted it by hand. So each stage checks the files it owns before it
reads them (`parquet_problem`, `safetensors_problem`): the footer, the schema, the declared sizes. A damaged
one moves to `<partition>/quarantine/<stage>/` with a JSON record beside it (where it was, why, when, what it
held when known), so nothing is deleted and a person can put it back; the stage then goes on as if the file
had never been written: its answers are asked again, its table rebuilt, its shard recomputed. The
`quarantined_files` check and the report list the records.
"""

from __future__ import annotations

import json
import os
import struct
import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import polars as pl

if TYPE_CHECKING:
    from polars._typing import PolarsDataType

from .files import write_json

QUARANTINE_DIR = "quarantine"  # inside a partition's folder: one sub-folder per stage
RECORDS = "records"  # inside a stage's: the JSON records, apart from the files (a check reads only these)
# The stages that check their files and set damaged ones aside.
QUARANTINE_STAGES = ("prompts", "responses", "tokens", "hidden_states")
MAGIC = b"PAR1"


@dataclass(frozen=True)
class Quarantined:
    """One file set aside: the record written beside it (JSON) and returned to the stage that moved it."""

    path: str  # where it was, relative to the partition's folder (where to put it back)
    moved_to: str  # where it is now, relative to the partition's folder
    reason: str
    stage: str
    at: float  # unix seconds
    size: int
    rows: int | None = None  # rows it held, when a tally of the table knew (the file itself cannot say)
    details: dict[str, Any] = field(default_factory=dict)  # e.g. the tokens and cost of the answers it held

    def describe(self) -> str:
        held = f", held {self.rows:,} rows" if self.rows is not None else ""
        return f"{self.path} ({self.stage}): {self.reason}{held}; now {self.moved_to}"


# -- finding damage ------------------------------------------------------------------------------------------
def has_parquet_magic(path: Path) -> bool:
    """The cheap test (8 bytes read): a file cut short or not Parquet at all fails it. For readers that cannot
    move files (another stage's): they skip such a file; the owning stage's sweep quarantines it."""
    try:
        with open(path, "rb") as fh:
            if fh.read(4) != MAGIC:
                return False
            fh.seek(-4, os.SEEK_END)
            return fh.read(4) == MAGIC
    except OSError:
        return False


def parquet_problem(
    path: Path, schema: Mapping[str, pl.DataType] | None = None, required: Iterable[str] = ()
) -> str | None:
    """Why `path` cannot be read as a table of `schema`, or None. Checks the magic bytes, the footer, that
    every `required` column exists, and that each column of `schema` it has is of a compatible type (parts
    written by older versions may lack newer columns; that is not damage)."""
    import pyarrow.parquet as pq

    size = path.stat().st_size
    if size < 12 or not has_parquet_magic(path):
        return f"not a Parquet file or cut short: no magic bytes at both ends ({size:,} bytes)"
    try:
        meta = pq.read_metadata(path)
        have = pl.read_parquet_schema(path)
    except Exception as e:
        return f"unreadable Parquet footer: {type(e).__name__}: {str(e)[:200]}"
    end = 0
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        for j in range(rg.num_columns):
            col = rg.column(j)
            start = col.dictionary_page_offset or col.data_page_offset
            end = max(end, (start or 0) + col.total_compressed_size)
    if end > size:
        return f"cut short: its footer places data up to byte {end:,}, the file has {size:,}"
    missing = [c for c in required if c not in have]
    if missing:
        return f"wrong schema: no column {', '.join(missing)} (has {', '.join(list(have)[:12])})"
    for name, want in (schema or {}).items():
        if name in have and not _compatible(have[name], want):
            return f"wrong schema: column {name} is {have[name]}, expected {want}"
    return None


def _compatible(have: PolarsDataType, want: PolarsDataType) -> bool:
    if have == want or have == pl.Null:
        return True
    if have.is_numeric() and want.is_numeric():
        return True
    if isinstance(have, pl.List) and isinstance(want, pl.List):
        return _compatible(have.inner, want.inner)
    if isinstance(have, pl.Struct) and isinstance(want, pl.Struct):
        # A struct with more fields than expected (a dataset's messages with their tool calls) still holds
        # every field a reader asks for.
        fields = {f.name: f.dtype for f in have.fields}
        return all(f.name in fields and _compatible(fields[f.name], f.dtype) for f in want.fields)
    return have.is_(want) or (have in (pl.String, pl.Utf8) and want in (pl.String, pl.Utf8))


def safetensors_header(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(the header of a safetensors file, None) or (None, why it cannot be read). Reads the header only, so it
    works on a file cut short (its metadata may still say what the file held)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                return None, f"cut short: {size:,} bytes, no header"
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, 100_000_000):
                return (
                    None,
                    f"not a safetensors file or cut short: header of {n:,} bytes in a file of {size:,}",
                )
            header = json.loads(fh.read(n))
    except (OSError, ValueError) as e:
        return None, f"not a safetensors file: {type(e).__name__}: {str(e)[:200]}"
    if not isinstance(header, dict):
        return None, "not a safetensors file: its header is not an object"
    return header, None


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file, or None: its header must parse and the file must be as
    long as the header says (a shard cut short keeps a readable header, so reading the header alone says
    nothing)."""
    header, why = safetensors_header(path)
    if header is None:
        return why
    try:
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, IndexError):
        return "not a safetensors file: a tensor entry has no data_offsets"
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
    size = path.stat().st_size
    if 8 + n + end != size:
        return f"cut short: its header describes {8 + n + end:,} bytes, the file has {size:,}"
    return None


# -- moving aside --------------------------------------------------------------------------------------------
def quarantine_dir(partition_dir: Path, stage: str | None = None) -> Path:
    base = Path(partition_dir) / QUARANTINE_DIR
    return base / stage if stage else base


def records_dir(partition_dir: Path, stage: str) -> Path:
    """Where a stage's records are: apart from the files, so that a reader of the records (a check, the
    report) of an object-store root fetches a few small JSON objects, not the damaged shards beside them."""
    return quarantine_dir(partition_dir, stage) / RECORDS


def quarantine(
    partition_dir: Path,
    path: Path,
    reason: str,
    stage: str,
    rows: int | None = None,
    details: dict[str, Any] | None = None,
) -> Quarantined:
    """Move `path` into the stage's quarantine folder and write its record (`records/<name>.json`). The move
    is a rename within the partition, so it is atomic: the file is either where it was or set aside, never
    lost."""
    partition_dir = Path(partition_dir)
    folder = quarantine_dir(partition_dir, stage)
    folder.mkdir(parents=True, exist_ok=True)
    rel = path.relative_to(partition_dir)
    now = time.time()
    target = folder / f"{time.time_ns():020d}-{str(rel).replace(os.sep, '__')}"
    size = path.stat().st_size
    record = Quarantined(
        path=str(rel),
        moved_to=str(target.relative_to(partition_dir)),
        reason=reason,
        stage=stage,
        at=now,
        size=size,
        rows=rows,
        details=dict(details or {}),
    )
    # The record first: a crash between the two leaves a record of a file still in place (the next sweep moves
    # it and writes another), never a moved file without its reason.
    write_json(asdict(record), records_dir(partition_dir, stage) / f"{target.name}.json")
    os.replace(path, target)
    return record


def quarantined(partition_dir: Path, stage: str | None = None) -> list[Quarantined]:
    """Every record under the partition's quarantine folder (or one stage's), oldest first."""
    out = []
    for p in sorted(quarantine_dir(partition_dir).glob(f"{stage or '*'}/{RECORDS}/*.json")):
        try:
            raw = json.loads(p.read_text())
            out.append(Quarantined(**raw))
        except (OSError, ValueError, TypeError):
            continue  # a record we cannot read is not worth failing a check over
    return sorted(out, key=lambda q: q.at)


def sweep_parquet(
    partition_dir: Path,
    paths: Iterable[Path],
    stage: str,
    schema: Mapping[str, pl.DataType] | None = None,
    required: Iterable[str] = (),
) -> list[Quarantined]:
    """Check each existing file of `paths`; quarantine the damaged ones. Returns what was set aside."""
    required = list(required)
    out = []
    for p in paths:
        if p.is_file() and (why := parquet_problem(p, schema, required)) is not None:
            out.append(quarantine(partition_dir, p, why, stage))
    return out
