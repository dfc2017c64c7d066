"""What an extraction will write, stated before any GPU hour is spent, and refused where it cannot fit.

Disk is the first wall at scale (a 7168-wide target stores 57 KB per token in bf16), and a run that fills its
volume after hours of GPU time has bought shards it cannot keep. So the plan sums the bytes of the shards it
will write (tokens x stored layers x H x bytes per value, plus FP8's scales and each token's id and mask) and,
on a local storage root, compares them with the free space before the first forward.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .fp8 import is_fp8
from .shards import bytes_per_token


class NotEnoughSpace(RuntimeError):
    """The planned shards do not fit the storage root's free space; nothing was computed."""


@dataclass(frozen=True)
class PlannedBytes:
    """The bytes the planned shards will take, and how they add up."""

    tokens: int
    samples: int
    shards: int
    hidden_size: int
    stored_layers: int  # the aux layers and the last
    storage_dtype: str

    @property
    def per_token(self) -> int:
        return bytes_per_token(self.hidden_size, self.storage_dtype, self.stored_layers)

    @property
    def total(self) -> int:
        return self.tokens * self.per_token

    def metadata(self) -> dict[str, Any]:
        return {
            "planned_bytes": self.total,
            "planned_tokens": self.tokens,
            "planned_samples": self.samples,
            "planned_shards": self.shards,
            "planned_bytes_per_token": self.per_token,
            "storage_dtype": self.storage_dtype,
            "planned_bytes_formula": self.formula(),
        }

    def formula(self) -> str:
        scales = " + a float32 scale per layer" if is_fp8(self.storage_dtype) else ""
        return (
            f"{self.tokens:,} tokens x {self.per_token:,} bytes ({self.stored_layers} layers x H "
            f"{self.hidden_size:,} in {self.storage_dtype}{scales}, + int32 id + int8 mask)"
        )

    def describe(self) -> str:
        return (
            f"{human(self.total)} ({self.tokens:,} tokens x {self.per_token:,} bytes in {self.storage_dtype})"
        )


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1000
    return f"{n:,.2f} PB"


def free_bytes(folder: Path) -> int:
    """Free space where `folder` lives (its nearest existing parent)."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def ensure_room(folder: Path, planned: PlannedBytes) -> int:
    """The free space under `folder`; raises NotEnoughSpace, naming the size, the free space and the storage
    dtype, when the planned shards would not fit."""
    free = free_bytes(folder)
    if planned.total > free:
        raise NotEnoughSpace(
            f"the planned hidden-state shards need {planned.describe()} but {folder} has {human(free)} free "
            f"({free:,} bytes) with hidden_states.storage_dtype {planned.storage_dtype}; free space, move "
            "storage.root to a larger volume, or set hidden_states.storage_dtype: float8_e4m3fn (about half "
            "the bytes of bfloat16). Nothing was computed."
        )
    return free
