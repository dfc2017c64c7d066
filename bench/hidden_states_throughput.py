"""hidden_states extraction against a bare transformers forward over the same packed batches.

Overhead = extraction time (hooks, device-to-host copies, bf16 casts, safetensors writes, index) over the bare
forward's time on exactly the same rows (goal <= 10%). Also: padding share (goal 0) and bytes written per token
against 8·H (bf16: three aux layers + the last layer).

Runs on whatever device is there (CPU here); `bench/gpu_hidden_states.py` is the prepared script for a real GPU.
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
from eagle3_assets.core.target.loading import pick_device, shared_model


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


def run(quick: bool = False) -> dict:
    n = 48 if quick else 192
    settings = ExtractionSettings(hidden=HiddenStatesConfig(shard_bytes=64 * 1024**2))
    with tempfile.TemporaryDirectory() as tmp:
        layout = DatasetLayout(Path(tmp), "B1").ensure()
        synthetic_tokens(layout, n, vocab=49152, lo=64, hi=512)
        bare_forward_seconds(settings, layout.tokens)  # warm-up: weights loaded, kernels chosen
        bare_s, tokens = bare_forward_seconds(settings, layout.tokens)
        t0 = time.perf_counter()
        _, stats, index = extract_dataset(layout, settings, log=lambda m: None)
        extract_s = time.perf_counter() - t0
        size = sum(p.stat().st_size for p in layout.hidden_states_dir.glob("shard-*.safetensors"))
    hidden = 576
    r = {
        "device": pick_device(settings.hidden.device),
        "samples": n,
        "tokens": tokens,
        "bare_forward_tok_s": tokens / bare_s,
        "extraction_tok_s": tokens / extract_s,
        "overhead": extract_s / bare_s - 1,
        "padding_share": stats.padded_tokens / max(stats.tokens, 1),
        "bytes_per_token": size / tokens,
        "ideal_bytes_per_token": 8 * hidden,
        "index_rows": index.height,
    }
    print(f"{n} samples, {tokens:,} tokens on {r['device']} (SmolLM2, H = {hidden})")
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
    return r
