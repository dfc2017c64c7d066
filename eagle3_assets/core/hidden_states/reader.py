"""Random access to one sample's stored states, dequantized where the shards hold FP8."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from ..storage.layout import HIDDEN_STATES_INDEX
from .fp8 import STATE_TENSORS, dequantize, scales_name


class HiddenStatesReader:
    """Random access by id: reads only that sample's rows from its shard (safetensors slices, memory-mapped)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        index = pl.read_parquet(self.folder / HIDDEN_STATES_INDEX)
        self._where = {r["id"]: (r["shard"], r["position"]) for r in index.iter_rows(named=True)}
        self._cu: dict[str, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._where)

    def ids(self) -> list[str]:
        return list(self._where)

    def sample(self, sid: str, framework: str = "pt", raw: bool = False) -> dict[str, Any]:
        """The sample's rows. States stored in FP8 come dequantized (float32, the contract's reading); `raw`
        (torch only) returns them as stored, with their `<name>_scales` beside them."""
        from safetensors import safe_open

        shard, pos = self._where[sid]
        path = str(self.folder / shard)
        with safe_open(path, framework="pt" if framework == "np" else framework) as f:
            if shard not in self._cu:
                self._cu[shard] = np.asarray(f.get_tensor("cu_seqlens"))
            a, b = int(self._cu[shard][pos]), int(self._cu[shard][pos + 1])
            keys = set(f.keys())
            out = {k: f.get_slice(k)[a:b] for k in ("input_ids", "loss_mask", *STATE_TENSORS)}
            scales = {k: f.get_slice(scales_name(k))[a:b] for k in STATE_TENSORS if scales_name(k) in keys}
        if raw:
            return {**out, **{scales_name(k): v for k, v in scales.items()}}
        for k, v in scales.items():
            out[k] = dequantize(out[k], v)
        return {k: v.numpy() for k, v in out.items()} if framework == "np" else out
