"""The rules behind the hidden_states checks, as plain functions over the stored shards (testable without Dagster).

Wrong hidden states waste GPU-days before anyone notices (states silently wrong under chunked prefill, a library
upgrade that wrote zero files, ids shifted by one), so a partition's states pass only when: every token row has a
sample; the ids and loss mask stored beside the states are tokens.parquet's; every value is finite; every shard
describes the same extraction (model, revision, tokenizer, layers, dtype) with consistent shapes; and a few samples
recomputed by an independent path — a plain forward with `output_hidden_states`, not the extraction's hooks and
packing — agree with what is stored.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from ..report.validation import Verdict
from .shards import finished_shards, input_hash

# Per-token cosine similarity of the stored states against an fp32 recomputation, by the dtype the extraction
# computed in. fp32 compute, stored in bf16: the only difference is the final rounding to 8 mantissa bits
# (unit roundoff u = 2^-9, cosine ≥ 1 - u²/2 per token in theory, ≥ 0.99999 measured), so every token must reach
# 0.999. Half-precision compute (a bf16 server, a bf16 GPU forward): every layer's output is rounded to 8 bits and two
# independent paths (other kernels, other summation orders) drift apart by about sqrt(L)·u relative per token; most
# tokens stay ≥ 0.9999, but the few tokens with massive activations (values of 1e4 on a handful of channels, the
# first token of every sample) concentrate the error: measured 0.995-0.999 for a bf16 vLLM server against fp32 on
# SmolLM2 (and 0.9978 even against a bf16 transformers forward). So half precision is held to the median token
# ≥ 0.999 and every token ≥ 0.99. What the check exists to catch stays far below either bar: a layer off by one
# scores a median ≤ 0.977 and a worst token ≤ 0.93, another sample's states near 0.
SPOT_RULES = {  # compute dtype -> (min over tokens, median over tokens), per stored tensor
    "float32": (0.999, 0.999),
    "bfloat16": (0.99, 0.999),
    "float16": (0.99, 0.999),
}
SPOT_COSINE = SPOT_RULES["float32"][0]
FINITE_CHUNK_ROWS = 65_536


def coverage(tokens: pl.DataFrame, index: pl.DataFrame, skipped: dict[str, str]) -> Verdict:
    """Every token row has a sample (or a recorded reason it was skipped), and no sample is left over."""
    want = set(tokens["id"].to_list())
    have = set(index["id"].to_list())
    missing = sorted(want - have - set(skipped))
    extra = sorted(have - want)
    return Verdict(
        not missing and not extra and (bool(have) or not want),
        {
            "token_rows": len(want),
            "samples": len(have),
            "missing": len(missing),
            "skipped_too_long": len(set(skipped) & want),
            "not_in_tokens": len(extra),
            "examples": json.dumps((missing or extra)[:5]),
        },
    )


def ids_match(folder: Path, tokens: pl.DataFrame | pl.LazyFrame) -> Verdict:
    """The input_ids and loss_mask stored in each shard are exactly tokens.parquet's rows for those ids.

    Compared through a 64-bit hash per row and column (polars' hash of the list, the same function on both sides):
    tokens.parquet is reduced to its hashes by the streaming engine and each shard is hashed on its own, so memory
    holds hashes, not the partition's ids (200,000 rows of 2,500 ids would not fit as Python lists)."""
    from safetensors import safe_open

    want = (
        tokens.lazy()
        .select("id", *_list_hashes(pl.col("input_ids"), pl.col("loss_mask")))
        .collect(engine="streaming")
    )
    by_id = {sid: (a, m) for sid, a, m in want.iter_rows()}
    checked = bad = 0
    examples: list[str] = []
    for name, meta in finished_shards(folder).items():
        with safe_open(str(folder / name), framework="np") as f:
            ids, mask, cu = f.get_tensor("input_ids"), f.get_tensor("loss_mask"), f.get_tensor("cu_seqlens")
        samples = meta["samples"]
        offsets = pa.array(np.asarray(cu[: len(samples) + 1], dtype=np.int64))
        stored = pl.DataFrame(
            {
                "input_ids": pl.from_arrow(
                    pa.LargeListArray.from_arrays(offsets, pa.array(ids.astype(np.int32)))
                ),
                "loss_mask": pl.from_arrow(
                    pa.LargeListArray.from_arrays(offsets, pa.array(mask.astype(np.int8)))
                ),
            }
        ).select(*_list_hashes(pl.col("input_ids"), pl.col("loss_mask")))
        for pos, ((sid, _n, h), got) in enumerate(zip(samples, stored.iter_rows(), strict=True)):
            checked += 1
            a, b = int(cu[pos]), int(cu[pos + 1])
            ok = by_id.get(sid) == got and h == input_hash(ids[a:b])
            if not ok:
                bad += 1
                if len(examples) < 5:
                    examples.append(sid)
    return Verdict(
        bad == 0, {"samples_checked": checked, "mismatched": bad, "examples": json.dumps(examples)}
    )


def _list_hashes(ids: pl.Expr, mask: pl.Expr) -> list[pl.Expr]:
    return [
        ids.cast(pl.List(pl.Int32)).hash(seed=11).alias("ids_hash"),
        mask.cast(pl.List(pl.Int8)).hash(seed=11).alias("mask_hash"),
    ]


def finite(folder: Path) -> Verdict:
    """No NaN or Inf anywhere in the stored states (read a slice at a time: memory stays bounded)."""
    import torch
    from safetensors import safe_open

    bad: dict[str, int] = {}
    values = 0
    for name in finished_shards(folder):
        with safe_open(str(folder / name), framework="pt") as f:
            for key in ("aux_hidden_states", "last_hidden_state"):
                view = f.get_slice(key)
                rows = view.get_shape()[0]
                for a in range(0, rows, FINITE_CHUNK_ROWS):
                    t = view[a : a + FINITE_CHUNK_ROWS]
                    values += t.numel()
                    n = int((~torch.isfinite(t)).sum())
                    if n:
                        bad[f"{name}:{key}"] = bad.get(f"{name}:{key}", 0) + n
    return Verdict(not bad, {"values": values, "non_finite": sum(bad.values()), "where": json.dumps(bad)})


def consistent(folder: Path, expected: dict[str, str]) -> Verdict:
    """Every shard describes the same extraction as the config asks for, and its tensors have matching shapes."""
    from safetensors import safe_open

    problems: list[str] = []
    shards = finished_shards(folder)
    for name, meta in shards.items():
        for key, want in expected.items():
            if str(meta.get(key, "")) != str(want):
                problems.append(f"{name}: {key} is {meta.get(key)!r}, expected {want!r}")
        with safe_open(str(folder / name), framework="pt") as f:
            shapes = {k: list(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        n = len(meta["samples"])
        tokens = sum(s[1] for s in meta["samples"])
        hidden = int(meta.get("hidden_size", 0))
        n_aux = len(json.loads(meta.get("aux_layers", "[]")))
        want_shapes = {
            "input_ids": [tokens],
            "loss_mask": [tokens],
            "cu_seqlens": [n + 1],
            "aux_hidden_states": [tokens, n_aux * hidden],
            "last_hidden_state": [tokens, hidden],
        }
        for key, shape in want_shapes.items():
            if shapes.get(key) != shape:
                problems.append(f"{name}: {key} has shape {shapes.get(key)}, expected {shape}")
    return Verdict(
        bool(shards) and not problems,
        {"shards": len(shards), "problems": len(problems), "details": json.dumps(problems[:10])},
    )


def spot_check(folder: Path, model: Any, sample_ids: list[str]) -> Verdict:
    """Recompute a few samples with a plain fp32 forward (`output_hidden_states`, one sample per forward, no hooks,
    no packing) and compare with what is stored: aux layer i against hidden_states[i + 1], the stored last state
    through the model's own final norm against hidden_states[L]; held to the rule of the dtype the extraction
    computed in (`SPOT_RULES`)."""
    import torch

    from .shards import HiddenStatesReader, read_shard_metadata

    reader = HiddenStatesReader(folder)
    worst, worst_median, failing = 1.0, 1.0, []
    details: dict[str, list[float]] = {}
    base = getattr(model, "model", model)
    device = base.get_input_embeddings().weight.device
    compute_dtypes = set()
    for sid in sample_ids:
        stored = reader.sample(sid)
        shard, _ = reader._where[sid]
        meta = read_shard_metadata(folder / shard)
        aux_layers = json.loads(meta["aux_layers"])
        compute = meta.get("compute_dtype") or "float32"  # shards written before the key: fp32 compute on CPU
        compute_dtypes.add(compute)
        floor_min, floor_median = SPOT_RULES.get(compute, SPOT_RULES["bfloat16"])
        ids = stored["input_ids"].to(torch.long)[None].to(device)
        with torch.inference_mode():
            out = base(input_ids=ids, output_hidden_states=True, use_cache=False)
            hs = out.hidden_states
            hidden = hs[0].shape[-1]
            aux = stored["aux_hidden_states"].float().to(device)
            pairs = [
                (f"aux{layer}", aux[:, k * hidden : (k + 1) * hidden], hs[layer + 1][0].float())
                for k, layer in enumerate(aux_layers)
            ]
            norm = getattr(base, "norm", None) or (lambda x: x)
            last = norm(stored["last_hidden_state"].to(device, dtype=hs[-1].dtype)).float()
            pairs.append(("last", last, hs[-1][0].float()))
            for name, got, want in pairs:
                low, median = _cosines(got, want)
                details[f"{sid}:{name}"] = [round(low, 6), round(median, 6)]
                worst, worst_median = min(worst, low), min(worst_median, median)
                if low < floor_min or median < floor_median:
                    failing.append(f"{sid}:{name}")
    rules = {d: SPOT_RULES.get(d, SPOT_RULES["bfloat16"]) for d in sorted(compute_dtypes)}
    return Verdict(
        bool(sample_ids) and not failing,
        {
            "samples": len(sample_ids),
            "min_token_cosine": round(worst, 6),
            "min_median_token_cosine": round(worst_median, 6),
            "compute_dtype": ", ".join(sorted(compute_dtypes)),
            "rule": json.dumps({d: {"every_token": a, "median_token": b} for d, (a, b) in rules.items()}),
            "threshold": min(a for a, _ in rules.values()) if rules else SPOT_COSINE,
            "failing": json.dumps(failing[:10]),
            "per_tensor_min_median": json.dumps(details),
        },
    )


def _cosines(a: Any, b: Any) -> tuple[float, float]:
    """(min, median) per-token cosine; (-1, -1) when the shapes differ."""
    import torch

    if a.shape != b.shape:
        return -1.0, -1.0
    c = torch.nn.functional.cosine_similarity(a, b, dim=-1)
    return float(c.min()), float(c.median())


def spot_sample_ids(index: pl.DataFrame, n: int = 3) -> list[str]:
    """A few samples across the length range (shortest, median, longest), deterministic."""
    if index.height == 0:
        return []
    ordered = index.sort(["n_tokens", "id"])["id"].to_list()
    picks = {ordered[0], ordered[len(ordered) // 2], ordered[-1]}
    return sorted(picks)[:n]
