"""How tokens.parquet is written: in streamed chunks, dictionary-encoded where few values repeat, with the
build's state in the footer; kept rows copied or appended as row groups without decoding them again."""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from ..storage.files import atomic_write
from ..storage.parquet_append import append_file
from .chunks import TOKENS_SCHEMA


def place_tokens(
    path: Path, new: Path, keys: pl.DataFrame | None, batch_size: int, metadata: dict[str, str]
) -> None:
    """tokens.parquet = the earlier rows still current + the new rows (`new`, written with the final
    metadata).

    Every earlier row stands (`keys` None, a top-up): the new row groups are appended to the file's bytes,
    nothing old is decoded (a 1,000-row top-up of a 200k-row file costs a file copy, not a re-encode of
    gigabytes). No earlier file: `new` is the file. Some earlier rows are stale (a re-key): the kept rows are
    re-written."""
    if not path.exists() or "row_key" not in pq.read_schema(path).names:
        atomic_write(path, lambda tmp: os.replace(new, tmp))
        return
    if keys is None:
        try:
            atomic_write(path, lambda tmp: append_file(path, new, tmp))
            return
        except ValueError:  # an earlier file of another schema (another version of this stage): re-write it
            pass
    atomic_write(
        path,
        lambda tmp: write_chunks(
            tmp,
            metadata=metadata,
            frames=itertools.chain(
                kept_batches(path, keys, TOKENS_SCHEMA, batch_size),
                (batch_frame(b) for b in pq.ParquetFile(new).iter_batches(batch_size)),
            ),
        ),
    )


def batch_frame(batch: pa.RecordBatch) -> pl.DataFrame:
    """A record batch as a frame (`pl.from_arrow` is typed for any arrow data; a batch is always a frame)."""
    return cast(pl.DataFrame, pl.from_arrow(batch))


def kept_batches(
    path: Path, keys: pl.DataFrame | None, schema: dict[str, pl.DataType], batch_size: int
) -> Iterator[pl.DataFrame]:
    """The rows of an earlier output whose (id, row_key) is still current, a batch at a time (old token rows
    are ~13 KB each: a whole-table join would hold them all)."""
    if not path.exists() or "row_key" not in pq.read_schema(path).names:
        return
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
        df = batch_frame(batch)
        df = df.with_columns(pl.lit(None, dtype=t).alias(c) for c, t in schema.items() if c not in df.columns)
        kept = df.select(list(schema))
        if keys is not None:  # None: all of them
            kept = kept.join(keys, on=["id", "row_key"], how="semi")
        if kept.height:
            yield kept


def scan_with_keys(path: Path, schema: dict[str, pl.DataType]) -> pl.LazyFrame:
    """An earlier output with its row keys, or an empty frame (none yet, or one without a row_key column)."""
    if path.exists() and "row_key" in pq.read_schema(path).names:
        return pl.scan_parquet(path)
    return pl.LazyFrame(schema=schema)


STATE_KEY = "eagle3.tokens_state"


@dataclass(frozen=True)
class BuildState:
    """What a build of tokens.parquet read, kept in the file's footer: the next build compares it with what it
    reads to tell a top-up (only journal parts added since) from a build that must re-key every row."""

    fingerprint: str  # the tokenizer, its template and the stage's options
    prompts: str  # the version of prompts.parquet
    parts: list[str]  # the journal parts of responses, by file name
    # The stored answers left out because they no longer stand (`generation.binding`), as a digest: a change
    # there re-keys the rows even when the files read are the same.
    excluded: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def recorded_state(path: Path) -> BuildState | None:
    """What the last build of tokens.parquet read."""
    if not path.exists():
        return None
    raw = (pq.read_schema(path).metadata or {}).get(STATE_KEY.encode())
    if not raw:
        return None
    fields = json.loads(raw)
    return BuildState(**{k: v for k, v in fields.items() if k in BuildState.__dataclass_fields__})


def write_chunks(path: Path, frames: Iterator[pl.DataFrame], metadata: dict[str, str] | None = None) -> None:
    """Frames into one Parquet file, a row group each; no frames: an empty file with the full schema (and the
    metadata), written the same way so that rows can later be appended to it."""

    def arrow(df: pl.DataFrame) -> pa.Table:
        table = df.to_arrow()
        return (
            table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
            if metadata
            else table
        )

    writer: pq.ParquetWriter | None = None
    try:
        for df in frames:
            table = arrow(df)
            if writer is None:
                writer = _parquet_writer(path, table.schema)
            if df.height:
                writer.write_table(table)
        if writer is None:
            writer = _parquet_writer(path, arrow(pl.DataFrame(schema=TOKENS_SCHEMA)).schema)
    finally:
        if writer is not None:
            writer.close()


def _parquet_writer(path: Path, schema: pa.Schema) -> pq.ParquetWriter:
    # zstd level 1 (~1.5x faster than the default level, same size). Dictionary encoding only for the
    # few-valued string columns: tried on the token ids it costs 3.5x the write time (the writer builds a
    # dictionary of the vocabulary per chunk) and the file came out no smaller after zstd.
    return pq.ParquetWriter(
        path,
        schema,
        compression="zstd",
        compression_level=1,
        use_dictionary=[c for c in DICTIONARY_COLUMNS if c in schema.names],
    )


DICTIONARY_COLUMNS = ("ids_source", "mismatch", "finish_reason", "reason")
