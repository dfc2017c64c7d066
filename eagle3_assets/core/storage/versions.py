"""Data versions: content-derived, so a stage whose output did not change reports the same version and
declarative automation does not run the stages after it (a cron tick that buys nothing re-tokenizes nothing).
Every asset takes its version from here: of rows (order-independent), of a small file, or of a JSON-like
result."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import polars as pl


def rows_version(lf: pl.LazyFrame, columns: list[str]) -> str:
    """Order-independent: the row count and the sum of row hashes over `columns`."""
    row = (
        lf.select(
            pl.len().alias("n"),
            pl.concat_str([pl.col(c).cast(pl.String).fill_null("\x00") for c in columns], separator="\x1f")
            .hash(seed=11)
            .cast(pl.UInt128)
            .sum()
            .alias("h"),
        )
        .collect()
        .row(0)
    )
    return f"{row[0]}-{int(row[1] or 0) % (1 << 64):016x}"


def file_version(path: Path) -> str:
    """A small file's content hash (reports, indexes)."""
    return (
        hashlib.blake2b(Path(path).read_bytes(), digest_size=8).hexdigest() if Path(path).exists() else "none"
    )


def content_version(content: object) -> str:
    """A JSON-like result's hash (keys sorted): the same report gives the same version."""
    text = json.dumps(content, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
