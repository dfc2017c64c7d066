"""Reading a hidden_states folder: what its shards say they hold, and random access to one sample's stored
states (dequantized where the shards hold FP8)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from ..storage.layout import HIDDEN_STATES_INDEX
from .fp8 import STATE_TENSORS, dequantize, scales_name
from .layer_ids import output_hidden_states_ids


@dataclass(frozen=True)
class StoredStates:
    """What the shards of a hidden_states folder say about themselves (every shard of a folder says the same,
    which the consistency check enforces): the target they came from, its layers, the dtype they are stored
    in.
    """

    model: str | None
    revision: str | None
    tokenizer: str | None
    num_layers: int
    aux_layers: list[int]  # outputs of decoder layers, 0-based
    dtype: str

    @property
    def output_hidden_states_ids(self) -> list[int]:
        """The aux layers as vLLM and speculators count them (what a draft served by vLLM reads)."""
        return output_hidden_states_ids(self.aux_layers)

    @classmethod
    def read(cls, folder: Path) -> StoredStates:
        from .shards import finished_shards

        metas = list(finished_shards(folder).values())
        if not metas:
            raise FileNotFoundError(f"no hidden-state shards in {folder}")
        meta = metas[0]
        return cls(
            model=meta.get("model"),
            revision=meta.get("revision") or None,
            tokenizer=meta.get("tokenizer"),
            num_layers=int(meta["num_layers"]),
            aux_layers=json.loads(meta["aux_layers"]),
            dtype=str(meta.get("dtype", "")),
        )


class HiddenStatesReader:
    """Random access by id: reads only that sample's rows from its shard (safetensors slices,
    memory-mapped)."""

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
