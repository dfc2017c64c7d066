"""hidden_states extraction against a bare transformers forward over the same packed batches.

Overhead = extraction time (hooks, device-to-host copies, bf16 casts, safetensors writes, index) over the bare
forward's time on exactly the same rows (goal <= 10%). Also: padding share (goal 0) and bytes written per
token against 8·H (bf16: three aux layers + the last layer). FP8 storage (`storage_dtype: float8_e4m3fn`) on
the same rows: its cost against bf16 (the quantization; goal < 5%) and its bytes per token against bf16's
(goal <= 0.55x).

Runs on whatever device is there (CPU here); `bench/gpu_hidden_states.py` is the prepared script for a real
GPU.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

from eagle3_assets.config import HiddenStatesConfig
from eagle3_assets.core.hidden_states.extraction import ExtractionSettings, extract_dataset
from eagle3_assets.core.hidden_states.shards import pack_rows, row_budget
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.target_model.loading import pick_device, shared_model


def synthetic_tokens(layout: DatasetLayout, n: int, vocab: int, lo: int, hi: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    ids, inputs, masks = [], [], []
    for i in range(n):
        t = rng.randint(lo, hi)
        ids.append(f"s{i:06d}")
        inputs.append([rng.randrange(3, vocab) for _ in range(t)])
        masks.append([0] * (t // 3) + [1] * (t - t // 3))
    pl.DataFrame(
        {
            "id": ids,
            "input_ids": pl.Series(inputs, dtype=pl.List(pl.Int32)),
            "loss_mask": pl.Series(masks, dtype=pl.List(pl.Int8)),
        }
    ).write_parquet(layout.tokens)


def bare_forward_seconds(settings: ExtractionSettings, tokens_path: Path) -> tuple[float, int]:
    """The same packed rows through the plain base model: no hooks, no copies, no writes."""
    import torch

    device = pick_device(settings.hidden.device)
    model = shared_model(settings.model_ref, device, False)
    df = pl.read_parquet(tokens_path)
    seqs = sorted((np.asarray(x, dtype=np.int64) for x in df["input_ids"].to_list()), key=len)
    rows = pack_rows(
        [len(s) for s in seqs],
        row_budget(device, model.config._attn_implementation, settings.hidden.max_tokens_per_batch),
    )
    start = time.perf_counter()
    with torch.inference_mode():
        for row in rows:
            ids = np.concatenate([seqs[i] for i in row])
            pos = np.concatenate([np.arange(len(seqs[i])) for i in row])
            model.model(
                input_ids=torch.from_numpy(ids)[None].to(device),
                position_ids=torch.from_numpy(pos)[None].to(device),
                use_cache=False,
            )
        if device.startswith("cuda"):
            torch.cuda.synchronize()
    return time.perf_counter() - start, int(sum(len(s) for s in seqs))


def _extract(root: Path, tokens: Path, storage_dtype: str) -> tuple[float, int, int]:
    """(seconds, padded tokens, shard bytes) of one extraction of `tokens` stored in `storage_dtype`."""
    import shutil

    layout = DatasetLayout(root / f"{storage_dtype}-{time.monotonic_ns()}", "B1").ensure()
    shutil.copy(tokens, layout.tokens)
    settings = ExtractionSettings(
        hidden=HiddenStatesConfig(shard_bytes=64 * 1024**2, storage_dtype=storage_dtype)
    )
    t0 = time.perf_counter()
    _, stats, _ = extract_dataset(layout, settings, log=lambda m: None)
    seconds = time.perf_counter() - t0
    size = sum(p.stat().st_size for p in layout.hidden_states_dir.glob("shard-*.safetensors"))
    return seconds, stats.padded_tokens, size


def run(quick: bool = False) -> dict:
    """bf16 extraction against the bare forward; FP8 storage against bf16 (throughput and bytes)."""
    n = 48 if quick else 192
    settings = ExtractionSettings(hidden=HiddenStatesConfig(shard_bytes=64 * 1024**2))
    with tempfile.TemporaryDirectory() as tmp:
        layout = DatasetLayout(Path(tmp), "B1").ensure()
        synthetic_tokens(layout, n, vocab=49152, lo=64, hi=512)
        bare_forward_seconds(settings, layout.tokens)  # warm-up: weights loaded, kernels chosen
        bare_s, tokens = bare_forward_seconds(settings, layout.tokens)
        # Interleaved, the best of each: a slower neighbour on the machine slows both dtypes alike.
        bf16_s = fp8_s = float("inf")
        for _ in range(1 if quick else 2):
            s, padded, size = _extract(Path(tmp), layout.tokens, "bfloat16")
            bf16_s = min(bf16_s, s)
            s, _, fp8_size = _extract(Path(tmp), layout.tokens, "float8_e4m3fn")
            fp8_s = min(fp8_s, s)
    hidden = 576
    r = {
        "device": pick_device(settings.hidden.device),
        "samples": n,
        "tokens": tokens,
        "bare_forward_tok_s": tokens / bare_s,
        "extraction_tok_s": tokens / bf16_s,
        "overhead": bf16_s / bare_s - 1,
        "padding_share": padded / max(tokens, 1),
        "bytes_per_token": size / tokens,
        "ideal_bytes_per_token": 8 * hidden,
        "fp8_extraction_tok_s": tokens / fp8_s,
        "fp8_cost_vs_bf16": fp8_s / bf16_s - 1,
        "fp8_bytes_per_token": fp8_size / tokens,
        "fp8_bytes_ratio": fp8_size / size,
    }
    _print(r, n, hidden)
    return r


def _print(r: dict, n: int, hidden: int) -> None:
    print(f"{n} samples, {r['tokens']:,} tokens on {r['device']} (SmolLM2, H = {hidden})")
    print(f"bare forward      {r['bare_forward_tok_s']:>10,.0f} tok/s")
    print(
        f"extraction        {r['extraction_tok_s']:>10,.0f} tok/s   overhead {100 * r['overhead']:+.1f}% "
        "(goal <= 10%)"
    )
    print(f"padding share     {100 * r['padding_share']:.1f}% (goal 0)")
    print(
        f"bytes per token   {r['bytes_per_token']:,.0f} vs 8·H = {8 * hidden:,} "
        f"(ratio {r['bytes_per_token'] / (8 * hidden):.3f}; the rest is ids, mask and headers)"
    )
    print(
        f"FP8 storage       {r['fp8_extraction_tok_s']:>10,.0f} tok/s   {100 * r['fp8_cost_vs_bf16']:+.1f}% "
        f"vs bf16 (goal < 5%); {r['fp8_bytes_per_token']:,.0f} bytes per token, {r['fp8_bytes_ratio']:.3f}x "
        "bf16 (goal <= 0.55)"
    )
