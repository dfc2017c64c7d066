"""Prepared GPU check for hidden-state extraction: proves the CUDA path and measures tokens/s, in under 5
minutes.

    python -m bench.gpu_hidden_states [--quick] [--out DIR]

What it does, on `cuda` (or `--device cpu` for a dry run of the script itself):

1. builds Llama-architecture models from config with random weights in bf16 (no download; throughput does
   not depend on the weights): SmolLM2's shape (30 layers, H = 576) and an 8B shape (32 layers, H = 4096,
   GQA 32/8);
2. checks on the device that packed rows (positions restarting per sample) give the same hidden states as
   one forward per sample (bf16 tolerance) with the attention implementation the pipeline picks
   (flash-attention 2 when installed, else sdpa);
3. measures a bare forward over the packed rows against the full extraction (hooks, device-to-host copies,
   safetensors shard written atomically) on the same samples; prints and saves tokens/s, overhead and
   bytes/token;
4. where a vLLM is installed (`--vllm-python`, default: this interpreter if it imports vllm): the same
   shapes through a vLLM server started with the exact `eagle3 vllm-serve` command (extract_hidden_states +
   the project's connector), a bare vLLM prefill of the same ids against the served extraction (tokens/s,
   overhead, bytes per token, connector files left), beside the transformers path's tokens/s.
   `--device cpu --vllm-python <the CPU build's python>` is the dry run of this part.

Needs torch, transformers, safetensors, numpy and polars (the extraction module writes Parquet indexes); on a
machine without internet carry polars as wheels (see the device tool's notes).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SHAPES = {
    "smollm2-135m": {
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
    },
    "llama-8b": {
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
    },
}


def build_model(shape: dict, device: str):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    attn = "sdpa"
    if device.startswith("cuda"):
        try:
            import flash_attn  # noqa: F401

            attn = "flash_attention_2"
        except ImportError:
            pass
    cfg = LlamaConfig(
        **shape, max_position_embeddings=32768, tie_word_embeddings=False, attn_implementation=attn
    )
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype)
    return model.eval(), attn


def samples(n_tokens: int, vocab: int, lo: int, hi: int, seed: int = 0):
    from eagle3_assets.core.hidden_states.shards import Sample

    rng = random.Random(seed)
    out, total = {}, 0
    while total < n_tokens:
        t = rng.randint(lo, hi)
        ids = np.array([rng.randrange(3, vocab) for _ in range(t)], dtype=np.int32)
        sid = f"s{len(out):06d}"
        out[sid] = Sample(sid, ids, np.ones(t, dtype=np.int8))
        total += t
    return out


def check_packing(model, device: str) -> float:
    """Max relative error between packed-row and per-sample hidden states of the last layer."""
    import torch

    from eagle3_assets.core.hidden_states.capture import HiddenStateCapture

    cap = HiddenStateCapture(model, [1, 2, 3])
    rng = np.random.default_rng(1)
    rows = [rng.integers(3, model.config.vocab_size, size=n).astype(np.int32) for n in (37, 120, 64, 250)]
    _, packed = cap.forward_packed(rows)
    worst, off = 0.0, 0
    for r in rows:
        _, single = cap.forward_packed([r])
        a, b = packed[off : off + len(r)].float(), single.float()
        worst = max(worst, float((a - b).norm() / b.norm()))
        off += len(r)
    cap.close()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return worst


def measure(name: str, shape: dict, device: str, n_tokens: int, budget: int) -> dict:
    import torch

    from eagle3_assets.core.hidden_states.capture import HiddenStateCapture
    from eagle3_assets.core.hidden_states.shards import (
        ShardPlan,
        ShardWriter,
        extract_shard,
        pack_rows,
        row_budget,
    )

    model, attn = build_model(shape, device)
    err = check_packing(model, device)
    data = samples(n_tokens, shape["vocab_size"], 128, 4096)
    order = sorted(data, key=lambda i: (len(data[i].input_ids), i))
    row_tokens = row_budget(device, attn, budget)
    rows = pack_rows([len(data[i].input_ids) for i in order], row_tokens)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def bare() -> float:
        t0 = time.perf_counter()
        with torch.inference_mode():
            for row in rows:
                ids = np.concatenate([data[order[i]].input_ids for i in row]).astype(np.int64)
                pos = np.concatenate([np.arange(len(data[order[i]].input_ids)) for i in row])
                model.model(
                    input_ids=torch.from_numpy(ids)[None].to(device),
                    position_ids=torch.from_numpy(pos)[None].to(device),
                    use_cache=False,
                )
        sync()
        return time.perf_counter() - t0

    bare()  # warm-up
    bare_s = bare()
    cap = HiddenStateCapture(model, [1, shape["num_hidden_layers"] // 2 - 1, shape["num_hidden_layers"] - 4])
    total = sum(len(d.input_ids) for d in data.values())
    with tempfile.TemporaryDirectory() as tmp:
        writer = ShardWriter()
        t0 = time.perf_counter()
        plan = ShardPlan("shard-bench.safetensors", tuple(order), total)
        extract_shard(cap, plan, data, Path(tmp), row_tokens, "bfloat16", {"model": name}, writer)
        writer.close()
        extract_s = time.perf_counter() - t0
        size = (Path(tmp) / plan.name).stat().st_size
    cap.close()
    h = shape["hidden_size"]
    r = {
        "model": name,
        "device": device,
        "attn": attn,
        "row_tokens": row_tokens,
        "tokens": total,
        "packing_max_rel_err": err,
        "bare_tok_s": total / bare_s,
        "extraction_tok_s": total / extract_s,
        "overhead": extract_s / bare_s - 1,
        "bytes_per_token": size / total,
        "ideal_bytes_per_token": 8 * h,
    }
    print(json.dumps(r), flush=True)
    return r


def vllm_python(arg: str | None) -> str | None:
    import importlib.util

    if arg:
        return arg
    return sys.executable if importlib.util.find_spec("vllm") is not None else None


def measure_vllm(name: str, shape: dict, device: str, n_tokens: int, python: str, work: Path) -> dict:
    """The shape served by vLLM: SmolLM2's real checkpoint, or random bf16 weights saved with SmolLM2's
    tokenizer (ids stay inside its vocabulary)."""
    import shutil

    import polars as pl

    from bench.vllm_hidden_states import measure_served
    from eagle3_assets.core.storage.layout import DatasetLayout
    from eagle3_assets.core.target_model.loading import builtin_dir

    smol = builtin_dir("smollm2")
    folder = smol
    if name != "smollm2-135m":
        import torch

        folder = work / name
        model, _ = build_model(shape, "cpu")
        model.to(torch.bfloat16).save_pretrained(folder)
        del model
        for f in smol.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")) or f.name == "generation_config.json":
                shutil.copy(f, folder / f.name)
    data = samples(n_tokens, min(shape["vocab_size"], 49152), 128, 1024 if device == "cpu" else 4096)
    rows = DatasetLayout(work / f"rows-{name}", "B1").ensure()
    pl.DataFrame(
        {
            "id": list(data),
            "input_ids": pl.Series([d.input_ids.tolist() for d in data.values()], dtype=pl.List(pl.Int32)),
            "loss_mask": pl.Series([d.loss_mask.tolist() for d in data.values()], dtype=pl.List(pl.Int8)),
        }
    ).write_parquet(rows.tokens)
    extra = [] if device == "cpu" else ["--gpu-memory-utilization", "0.85"]
    r = measure_served(
        str(folder), shape["num_hidden_layers"], rows, python, work / f"vllm-{name}", "bfloat16",
        cpu=device == "cpu", max_model_len=8192, extra_args=extra,
    )  # fmt: skip
    r["model"] = name
    print(json.dumps(r), flush=True)
    return r


def main(argv: list[str] | None = None) -> int:
    import torch

    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT"))
    p.add_argument(
        "--vllm-python", default=None, help="a python that imports vllm (default: this one, if it does)"
    )
    args = p.parse_args(argv)
    if args.device.startswith("cuda"):
        print(f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    plan = [
        ("smollm2-135m", 20_000 if args.quick or args.device == "cpu" else 2_000_000, 16384),
        ("llama-8b", 4_000 if args.device == "cpu" else 400_000, 16384),
    ]
    results = []
    for name, n_tokens, budget in plan:
        if args.device == "cpu" and name == "llama-8b":
            continue  # 32 GB of fp32 weights: a dry run on CPU checks the script with the small shape only
        results.append(measure(name, SHAPES[name], args.device, n_tokens, budget))
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()  # the previous model is gone with measure()'s frame
    ok = all(r["packing_max_rel_err"] < 3e-2 for r in results)
    print(f"packing check {'passed' if ok else 'FAILED'}")
    for r in results:
        print(
            f"{r['model']:>14} on {r['device']} ({r['attn']}): bare {r['bare_tok_s']:,.0f} tok/s, extraction "
            f"{r['extraction_tok_s']:,.0f} tok/s ({100 * r['overhead']:+.1f}%), {r['bytes_per_token']:,.0f} "
            f"B/token vs 8·H {r['ideal_bytes_per_token']:,}"
        )
    served: list[dict] = []
    python = vllm_python(args.vllm_python)
    if python is None:
        print("vLLM: not installed here (pass --vllm-python); the served path was not measured")
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for name, n_tokens, _ in plan:
                if args.device == "cpu" and name == "llama-8b":
                    continue
                if args.quick and name == "llama-8b":
                    continue  # saving 16 GB of random weights for the server takes a minute of the quick run
                served.append(measure_vllm(name, SHAPES[name], args.device, n_tokens, python, Path(tmp)))
        local = {r["model"]: r["extraction_tok_s"] for r in results}
        for r in served:
            ratio = r["served_tok_s"] / local[r["model"]] if r["model"] in local else float("nan")
            print(
                f"{r['model']:>14} through vLLM: {r['served_tok_s']:,.0f} tok/s ({ratio:.2f}x the "
                f"transformers path), bare prefill {r['bare_prefill_tok_s']:,.0f} tok/s "
                f"({100 * r['over_bare']:+.1f}%), connector files {r['connector_bytes_per_token']:,.0f} "
                f"B/token, {r['files_left']} left behind"
            )
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_hidden_states.json").write_text(
            json.dumps({"transformers": results, "vllm": served}, indent=2)
        )
    return 0 if ok and all(r["files_left"] == 0 for r in served) else 1


if __name__ == "__main__":
    sys.exit(main())
