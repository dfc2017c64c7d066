"""Crash-safe file writes: a reader sees the old file or the new one, never half of one."""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl


def atomic_write(path: Path, write: Callable[[Path], object]) -> Path:
    """Call `write(tmp)` on a hidden temporary file beside `path`, fsync it, then rename it into place.

    The temporary name does not end in the target's suffix, so globs such as `responses/*.parquet` never see
    it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def available_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup CPU quota (a container given 4
    CPUs on a 64-core node must start 4 workers, not 64)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            n = min(n, max(1, int(int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, n)


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


# Row groups of a few thousand rows: a reader can stream any file a batch at a time (answers are ~10 KB each,
# so one row group per file would make every reader hold the whole file).
ROW_GROUP_ROWS = 4096


def write_parquet(df: pl.DataFrame, path: Path) -> Path:
    return atomic_write(
        path,
        lambda tmp: df.write_parquet(tmp, compression="zstd", statistics=True, row_group_size=ROW_GROUP_ROWS),
    )


def sink_parquet(lf: pl.LazyFrame, path: Path) -> Path:
    """Stream a lazy query into a Parquet file (memory bounded by polars' streaming engine), atomically."""
    return atomic_write(
        path,
        lambda tmp: lf.sink_parquet(tmp, compression="zstd", statistics=True, row_group_size=ROW_GROUP_ROWS),
    )


def write_json(obj: Any, path: Path) -> Path:
    text = json.dumps(obj, indent=2, sort_keys=False, default=str, ensure_ascii=False)
    return atomic_write(path, lambda tmp: tmp.write_text(text + "\n", encoding="utf-8"))


def write_text(text: str, path: Path) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def remove_stale_temporaries(folder: Path, older_than_s: float = 600.0) -> int:
    """Delete temporaries a killed process left behind (never renamed, so nothing refers to them).

    Only old ones: a temporary that is seconds old may belong to a writer that is still alive.
    """
    n = 0
    if folder.is_dir():
        now = time.time()
        for p in folder.glob(".*.tmp"):
            try:
                if now - p.stat().st_mtime > older_than_s:
                    p.unlink(missing_ok=True)
                    n += 1
            except FileNotFoundError:
                pass
    return n
