"""The spot check's rules: how close stored states must be to an independent fp32 recomputation, by the dtype
the extraction computed in and the dtype the shards store.

Direction (per-token cosine). fp32 compute, stored in bf16: the only difference is the final rounding to 8
mantissa bits (unit roundoff u = 2^-9, cosine ≥ 1 - u²/2 per token in theory, ≥ 0.99999 measured), so every
token must reach 0.999. Half-precision compute (a bf16 server, a bf16 GPU forward): every layer's output is
rounded to 8 bits and two independent paths (other kernels, other summation orders) drift apart by about
sqrt(L)·u relative per token; most tokens stay ≥ 0.9999, but the few tokens with massive activations (values
of 1e4 on a handful of channels, the first token of every sample) concentrate the error: measured 0.995-0.999
for a bf16 vLLM server against fp32 on SmolLM2 (and 0.9978 even against a bf16 transformers forward). So half
precision is held to the median token ≥ 0.999 and every token ≥ 0.99. What the check exists to catch stays far
below either bar: a layer off by one scores a median ≤ 0.977 and a worst token ≤ 0.93, another sample's states
near 0.

FP8 storage (float8_e4m3fn, a scale per token and layer): 3 mantissa bits round each value by at most 2^-4
relative (the block's largest value lands on 448, so the block sits in the normal range but for values 2^9
below its largest), so a token's cosine is ≥ 1 - 2^-9 ≈ 0.998 in theory; measured on SmolLM2 (fp32 compute):
every token ≥ 0.99957, median ≥ 0.99972, exactly a per-token per-layer rounding of the fp32 forward. Held to
every token ≥ 0.998 and the median ≥ 0.999 (half-precision compute keeps its own, looser, every-token bar).

Magnitude (per-token |‖stored‖ / ‖recomputed‖ - 1|). A cosine cannot see a per-token factor, and FP8 stores
exactly that: a scale per token and layer. Wrong scales (swapped between tokens, rows shifted by one) leave
every cosine intact and change the norms. FP8 rounding moves a token's norm by at most 2^-4 (|‖x̂‖ - ‖x‖| ≤
‖x̂ - x‖); measured: every token ≤ 0.0146, median ≤ 0.005 with fp32 compute; ≤ 0.037 and median ≤ 0.006 from a
bf16 forward. Scales swapped between two neighbouring tokens measured 0.10-0.56, scales shifted by a row a
median of 0.08-0.5. So FP8 shards are held to every token ≤ 2^-4 (fp32 compute; ≤ 2^-3 for half-precision
compute) and the median token ≤ 0.02.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .fp8 import is_fp8

SPOT_RULES = {  # compute dtype -> (min over tokens, median over tokens), per stored tensor
    "float32": (0.999, 0.999),
    "bfloat16": (0.99, 0.999),
    "float16": (0.99, 0.999),
}
SPOT_COSINE = SPOT_RULES["float32"][0]
FP8_COSINE = (0.998, 0.999)  # (every token, median token), from the 2^-4 rounding bound
FP8_NORM = {"float32": 2**-4, "half": 2**-3}  # every token's norm deviation, by compute precision
FP8_NORM_MEDIAN = 0.02


@dataclass(frozen=True)
class Agreement:
    """Per-token agreement of stored states with a recomputation: cosine (direction) and norm deviation
    (magnitude), each as its worst token and its median token."""

    min_cosine: float
    median_cosine: float
    max_norm_dev: float
    median_norm_dev: float

    @classmethod
    def of(cls, got: Any, want: Any) -> Agreement:
        """Rows are tokens; shapes that differ agree in nothing."""
        import torch

        if got.shape != want.shape:
            return cls(-1.0, -1.0, float("inf"), float("inf"))
        got, want = got.float(), want.float()
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        dev = (got.norm(dim=-1) / want.norm(dim=-1).clamp_min(1e-30) - 1).abs()
        return cls(float(cos.min()), float(cos.median()), float(dev.max()), float(dev.median()))


@dataclass(frozen=True)
class SpotRule:
    """What a stored tensor must reach against the recomputation: cosine bars always; norm bars where a scale
    per token is stored (FP8), None elsewhere."""

    every_token: float
    median_token: float
    norm_every_token: float | None = None
    norm_median_token: float | None = None

    def passes(self, a: Agreement) -> bool:
        if a.min_cosine < self.every_token or a.median_cosine < self.median_token:
            return False
        if self.norm_every_token is None:
            return True
        return a.max_norm_dev <= self.norm_every_token and a.median_norm_dev <= (
            self.norm_median_token or 0.0
        )

    def describe(self) -> dict[str, float]:
        out = {"every_token": self.every_token, "median_token": self.median_token}
        if self.norm_every_token is not None:
            out["norm_deviation_every_token"] = self.norm_every_token
            out["norm_deviation_median_token"] = self.norm_median_token or 0.0
        return out


def spot_rule(compute_dtype: str, storage_dtype: str = "bfloat16") -> SpotRule:
    """The rule for states computed in `compute_dtype` and stored in `storage_dtype` (module docstring)."""
    every, median = SPOT_RULES.get(compute_dtype, SPOT_RULES["bfloat16"])
    if not is_fp8(storage_dtype):
        return SpotRule(every, median)
    half = compute_dtype != "float32"
    return SpotRule(
        min(every, FP8_COSINE[0]),
        min(median, FP8_COSINE[1]),
        FP8_NORM["half" if half else "float32"],
        FP8_NORM_MEDIAN,
    )


def rules_metadata(rules: dict[str, SpotRule]) -> dict[str, Any]:
    """The rules applied, by '<compute> -> <storage>', for the check's metadata."""
    return {
        "rule": json.dumps({k: r.describe() for k, r in sorted(rules.items())}),
        "threshold": min((r.every_token for r in rules.values()), default=SPOT_COSINE),
    }


def worst_of(a: Agreement, b: Agreement) -> Agreement:
    return Agreement(
        min(a.min_cosine, b.min_cosine),
        min(a.median_cosine, b.median_cosine),
        max(a.max_norm_dev, b.max_norm_dev),
        max(a.median_norm_dev, b.median_norm_dev),
    )


def agreement_summary(worst: Agreement) -> dict[str, Any]:
    return {
        "min_token_cosine": round(worst.min_cosine, 6),
        "min_median_token_cosine": round(worst.median_cosine, 6),
        "max_token_norm_deviation": round(worst.max_norm_dev, 6),
        "max_median_token_norm_deviation": round(worst.median_norm_dev, 6),
    }


@dataclass(frozen=True)
class StoredExtraction:
    """What a sample's shard says about how its states were made: the aux layers and the compute dtype."""

    aux_layers: list[int]
    compute_dtype: str
    storage_dtype: str = "bfloat16"

    @classmethod
    def of(cls, folder: Path, shard: str) -> StoredExtraction:
        from .shards import read_shard_metadata

        meta = read_shard_metadata(folder / shard)
        # shards written before the key: fp32 compute on CPU
        compute = meta.get("compute_dtype") or "float32"
        return cls(json.loads(meta["aux_layers"]), compute, meta.get("dtype") or "bfloat16")

    @property
    def first(self) -> int:
        return min(self.aux_layers)

    @property
    def rule(self) -> SpotRule:
        return spot_rule(self.compute_dtype, self.storage_dtype)

    @property
    def rule_key(self) -> str:
        """The compute dtype, and the storage dtype where it sets its own rule (FP8)."""
        return (
            f"{self.compute_dtype} -> {self.storage_dtype}"
            if is_fp8(self.storage_dtype)
            else self.compute_dtype
        )

    def first_block(self, aux: Any, hidden: int) -> Any:
        k = self.aux_layers.index(self.first)
        return aux[:, k * hidden : (k + 1) * hidden].float()
