"""The rules behind the hidden_states checks, as plain functions over the stored shards (testable without
Dagster).

Wrong hidden states waste GPU-days before anyone notices (states silently wrong under chunked prefill, a
library upgrade that wrote zero files, ids shifted by one), so a partition's states pass only when: every
token row has a sample; the ids and loss mask stored beside the states are tokens.parquet's; every value is
finite; every shard describes the same extraction (model, revision, tokenizer, layers, dtype) with consistent
shapes; and a few samples recomputed by an independent path — a plain forward with `output_hidden_states`, not
the extraction's hooks and packing — agree with what is stored.

For a served target (`hidden_states.engine: vllm`, or one that does not fit the checking machine) the
recomputation uses pieces of the checkpoint only (`spot_check_pieces`): the shallowest aux layer recomputed
from the embedding and the first decoder layers, and the stored last states checked against the head.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from ..report.validation import Verdict
from .fp8 import STATE_TENSORS, dequantize, is_fp8, scale_problems, scales_name
from .shards import finished_shards, input_hash
from .spot_rules import (
    Agreement,
    SpotRule,
    StoredExtraction,
    agreement_summary,
    rules_metadata,
    worst_of,
)

# The rules by compute and storage dtype, and why: spot_rules.py.
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

    Compared through a 64-bit hash per row and column (polars' hash of the list, the same function on both
    sides): tokens.parquet is reduced to its hashes by the streaming engine and each shard is hashed on its
    own, so memory holds hashes, not the partition's ids (200,000 rows of 2,500 ids would not fit as Python
    lists)."""
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
    """No NaN or Inf anywhere in the stored states, read as a trainer reads them (FP8: dequantized, so a scale
    of Inf or NaN shows), and no FP8 scale that quantization never writes (zero, negative, non-finite: a zero
    scale silently zeroes its token). A slice at a time: memory stays bounded."""
    from safetensors import safe_open

    bad: dict[str, int] = {}
    bad_scales: dict[str, int] = {}
    values = 0
    for name in finished_shards(folder):
        with safe_open(str(folder / name), framework="pt") as f:
            keys = set(f.keys())
            for key in STATE_TENSORS:
                scales = f.get_slice(scales_name(key)) if scales_name(key) in keys else None
                n_values, n_bad, n_scales = _scan(f.get_slice(key), scales)
                values += n_values
                if n_bad:
                    bad[f"{name}:{key}"] = n_bad
                if n_scales:
                    bad_scales[f"{name}:{scales_name(key)}"] = n_scales
    return Verdict(
        not bad and not bad_scales,
        {
            "values": values,
            "non_finite": sum(bad.values()),
            "where": json.dumps(bad),
            "bad_scales": sum(bad_scales.values()),
            "bad_scales_where": json.dumps(bad_scales),
        },
    )


def _scan(view: Any, scales: Any) -> tuple[int, int, int]:
    """(values, non-finite values, bad scales) of one stored tensor, dequantized where it has scales."""
    import torch

    values = non_finite = wrong = 0
    rows = view.get_shape()[0]
    for a in range(0, rows, FINITE_CHUNK_ROWS):
        t = view[a : a + FINITE_CHUNK_ROWS]
        if scales is not None:
            s = scales[a : a + FINITE_CHUNK_ROWS]
            wrong += scale_problems(s)
            t = dequantize(t, s)
        values += t.numel()
        non_finite += int((~torch.isfinite(t)).sum())
    return values, non_finite, wrong


def consistent(folder: Path, expected: dict[str, str]) -> Verdict:
    """Every shard describes the same extraction as the config asks for, and its tensors have matching
    shapes."""
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
        if is_fp8(meta.get("dtype", "")):
            want_shapes[scales_name("aux_hidden_states")] = [tokens, n_aux]
            want_shapes[scales_name("last_hidden_state")] = [tokens, 1]
        for key, shape in want_shapes.items():
            if shapes.get(key) != shape:
                problems.append(f"{name}: {key} has shape {shapes.get(key)}, expected {shape}")
        problems += [f"{name}: {p}" for p in _stored_dtypes(folder / name, meta.get("dtype", ""))]
    return Verdict(
        bool(shards) and not problems,
        {"shards": len(shards), "problems": len(problems), "details": json.dumps(problems[:10])},
    )


SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "F8_E4M3"}


def _stored_dtypes(path: Path, dtype: str) -> list[str]:
    """The states are stored in the dtype the metadata names (and FP8 scales in float32)."""
    from safetensors import safe_open

    want = {k: SAFETENSORS_DTYPES.get(dtype, dtype) for k in STATE_TENSORS}
    if is_fp8(dtype):
        want.update({scales_name(k): "F32" for k in STATE_TENSORS})
    with safe_open(str(path), framework="pt") as f:
        keys = set(f.keys())
        got = {k: f.get_slice(k).get_dtype() for k in want if k in keys}
    return [
        f"{k} is stored as {got[k]}, the metadata's dtype {dtype} says {w}"
        for k, w in want.items()
        if got.get(k, w) != w
    ]


def spot_check(folder: Path, model: Any, sample_ids: list[str]) -> Verdict:
    """Recompute a few samples with a plain fp32 forward (`output_hidden_states`, one sample per forward, no
    packing) and compare with what is stored: aux layer i against hidden_states[i + 1], the stored last state
    through the model's own final norm against hidden_states[L]; held to the rule of the dtype the extraction
    computed in and the shards store (`spot_rules`). FP8 shards also compare the stored last state with the
    last decoder layer's own output (a hook of this check's), since the final norm hides a wrong per-token
    scale."""
    from .reader import HiddenStatesReader

    reader = HiddenStatesReader(folder)
    worst = Agreement(1.0, 1.0, 0.0, 0.0)
    failing: list[str] = []
    details: dict[str, list[float]] = {}
    rules: dict[str, SpotRule] = {}
    compute_dtypes = set()
    for sid in sample_ids:
        how = StoredExtraction.of(folder, reader._where[sid][0])
        compute_dtypes.add(how.compute_dtype)
        rules[how.rule_key] = how.rule
        for name, got in _recomputed_pairs(model, reader.sample(sid), how):
            details[f"{sid}:{name}"] = [round(got.min_cosine, 6), round(got.median_cosine, 6)]
            if how.rule.norm_every_token is not None:
                details[f"{sid}:{name}"] += [round(got.max_norm_dev, 5), round(got.median_norm_dev, 5)]
            worst = worst_of(worst, got)
            if not how.rule.passes(got):
                failing.append(f"{sid}:{name}")
    return Verdict(
        bool(sample_ids) and not failing,
        {
            "samples": len(sample_ids),
            **agreement_summary(worst),
            "compute_dtype": ", ".join(sorted(compute_dtypes)),
            **rules_metadata(rules),
            "failing": json.dumps(failing[:10]),
            "per_tensor_min_median": json.dumps(details),
        },
    )


def _recomputed_pairs(
    model: Any, stored: dict[str, Any], how: StoredExtraction
) -> list[tuple[str, Agreement]]:
    """Each stored tensor's agreement with one plain fp32 forward of the sample."""
    import torch

    base = getattr(model, "model", model)
    device = base.get_input_embeddings().weight.device
    ids = stored["input_ids"].to(torch.long)[None].to(device)
    grabbed: dict[str, Any] = {}
    layers = getattr(base, "layers", None)
    hook = None
    if is_fp8(how.storage_dtype) and layers is not None:
        hook = layers[-1].register_forward_hook(
            lambda _m, _i, out: grabbed.__setitem__("last", out[0] if isinstance(out, tuple) else out)
        )
    try:
        with torch.inference_mode():
            hs = base(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    finally:
        if hook is not None:
            hook.remove()
    with torch.inference_mode():
        hidden = hs[0].shape[-1]
        aux = stored["aux_hidden_states"].float().to(device)
        out = [
            (f"aux{layer}", Agreement.of(aux[:, k * hidden : (k + 1) * hidden], hs[layer + 1][0]))
            for k, layer in enumerate(how.aux_layers)
        ]
        norm = getattr(base, "norm", None) or (lambda x: x)
        last = stored["last_hidden_state"].to(device, dtype=hs[-1].dtype)
        out.append(("last", _direction_only(Agreement.of(norm(last), hs[-1][0]))))
        if "last" in grabbed:
            out.append(("last_before_norm", Agreement.of(last, grabbed["last"][0])))
    return out


def _direction_only(a: Agreement) -> Agreement:
    """Through the final norm a token's magnitude is gone: only its direction counts."""
    return Agreement(a.min_cosine, a.median_cosine, 0.0, 0.0)


def spot_sample_ids(index: pl.DataFrame, n: int = 3) -> list[str]:
    """A few samples across the length range (shortest, median, longest), deterministic."""
    if index.height == 0:
        return []
    ordered = index.sort(["n_tokens", "id"])["id"].to_list()
    picks = {ordered[0], ordered[len(ordered) // 2], ordered[-1]}
    return sorted(picks)[:n]
