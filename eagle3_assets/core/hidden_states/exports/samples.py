"""The samples of an export: which ones (a sample a cut leaves untrainable is left out), in what order, how
their states are read (as stored or dequantized), cut to `max_len` and counted as they pass."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...storage.layout import HIDDEN_STATES_INDEX
from ..fp8 import is_fp8
from ..reader import HiddenStatesReader
from .base import Counts, ExportError, ExportFormat, ExportJob, ExportSample


def export_order(ids: list[str]) -> list[str]:
    """Ordered by a hash of the id: speculators holds out the last rows, and shards are ordered by length."""
    return sorted(ids, key=lambda sid: hashlib.blake2b(sid.encode(), digest_size=8).digest())


def _needed_lengths(folder: Path) -> dict[str, tuple[int, int | None]]:
    """id -> (tokens, the shortest cut that keeps one trained token before the sample's last; None: no such
    cut), from the shards' loss masks alone (a few bytes a token; the states are not read)."""
    import numpy as np
    import polars as pl
    from safetensors import safe_open

    index = pl.read_parquet(folder / HIDDEN_STATES_INDEX)
    out: dict[str, tuple[int, int | None]] = {}
    for (shard,), rows in index.group_by("shard"):
        with safe_open(str(folder / shard), framework="np") as f:
            cu, mask = f.get_tensor("cu_seqlens"), f.get_tensor("loss_mask")
        for sid, pos in rows.select("id", "position").iter_rows():
            m = mask[int(cu[pos]) : int(cu[pos + 1])]
            trained = np.flatnonzero(m[:-1])  # SpecForge never trains the last position (no next token)
            out[sid] = (len(m), int(trained[0]) + 2 if trained.size else None)
    return out


def plan_samples(folder: Path, fmt: ExportFormat, max_len: int | None, counts: Counts) -> list[str]:
    """The ids to export, in export order, or an ExportError when what is left trains nothing.

    A sample whose cut leaves no trained token (none before its last position, which SpecForge never trains)
    is left out rather than exported with an empty loss mask: no consumer learns from it and none skips it
    either. speculators and SpecForge divide by a clamped mask sum, so a batch of such samples trains nothing
    and reports a loss of 0.0 (speculators trained an export of only such samples at loss 0.0, without a
    warning), and a few of them still dilute each batch they share. Left out, they are counted
    (`dropped_samples` in the manifest, a log line) and the manifest's `samples` is what a consumer reads."""
    needed = _needed_lengths(folder)
    kept = [
        sid for sid, (_n, need) in needed.items() if need is not None and (max_len is None or need <= max_len)
    ]
    counts.dropped = len(needed) - len(kept)
    if len(kept) >= fmt.min_samples:
        return export_order(kept)
    cut = f"after the cut to max_len {max_len}" if max_len is not None else "before its last position"
    enough = sorted(need for _n, need in needed.values() if need is not None)
    k = fmt.min_samples
    if not kept:
        what = (
            f"none of its {len(needed)} samples keeps a trained (loss-mask) token {cut}: nothing to train on"
        )
    else:
        what = (
            f"only {len(kept)} of its {len(needed)} samples keeps a trained (loss-mask) token {cut}, and "
            f"{fmt.name} needs at least {k} (it holds out the last tenth for validation)"
        )
    fix = (
        f"use max_len >= {enough[k - 1]} to keep {k} sample{'s' if k > 1 else ''}, >= {enough[-1]} to keep "
        "every sample with a trained token, or no max_len to export every sample whole"
        if len(enough) >= k
        else "answer more prompts and materialise tokens and hidden_states again"
    )
    raise ExportError(f"{folder}: {what}; {fix}")


@dataclass(frozen=True)
class StatesAs:
    """How an export holds the states: as stored (`raw`: FP8 with its scales), or read dequantized and cast to
    `dtype` (None: as the reader returns them)."""

    raw: bool = False
    dtype: str | None = None

    @classmethod
    def of(cls, fmt: ExportFormat, source_dtype: str) -> StatesAs:
        if not is_fp8(source_dtype):
            return cls()
        return cls(raw=True) if fmt.reads_fp8 else cls(dtype="bfloat16")

    def read(self, reader: HiddenStatesReader, sid: str) -> dict[str, Any]:
        import torch

        s = reader.sample(sid, raw=self.raw)
        if self.dtype is not None:
            for k in ("aux_hidden_states", "last_hidden_state"):
                s[k] = s[k].to(getattr(torch, self.dtype))
        return s

    def manifest(self, source_dtype: str) -> dict[str, Any]:
        """The manifest's dtype entries: what the export holds, and from what where it differs."""
        if not is_fp8(source_dtype):
            return {"dtype": source_dtype}
        if self.raw:
            return {
                "dtype": source_dtype,
                "source_dtype": source_dtype,
                "dequantized": False,
                "scales": "hidden_states_scales float32 [S, 4, 1]: hidden_states.float() * "
                "hidden_states_scales (hs-connectors FP8Transfer; speculators --hidden-states-backend fp8)",
            }
        return {
            "dtype": self.dtype,
            "source_dtype": source_dtype,
            "dequantized": True,
            "note": f"this framework reads no FP8: the {source_dtype} shards were dequantized (values x "
            f"their per-token, per-layer scales) and stored in {self.dtype}",
        }


def export_samples(
    reader: HiddenStatesReader, ids: list[str], max_len: int | None, states: StatesAs, job: ExportJob
) -> Iterator[ExportSample]:
    """The samples in export order, cut to `max_len` tokens, counting tokens (`job.counts`) and trained token
    ids (`job.freq`) as they pass."""
    import torch

    counts = job.counts
    for i, sid in enumerate(ids):
        s = states.read(reader, sid)
        n = int(s["input_ids"].shape[0])
        counts.longest_source = max(counts.longest_source, n)
        if max_len is not None and n > max_len:
            s = {k: v[:max_len] for k, v in s.items()}
            counts.truncated += 1
            n = max_len
        counts.longest = max(counts.longest, n)
        tokens, mask = s["input_ids"].long(), s["loss_mask"].long()
        trained = tokens[mask.bool()]
        values, times = torch.unique(trained, return_counts=True)
        job.freq.update(dict(zip(values.tolist(), times.tolist(), strict=True)))
        counts.samples += 1
        counts.tokens += n
        counts.loss_tokens += int(trained.numel())
        yield ExportSample(i, sid, {**s, "input_ids": tokens, "loss_mask": mask})
