"""The main job at a production target's scale: eight datasets, one key with a limit, heavy-tailed streamed
answers and budgets that bind; through the real Dagster path (dagster dev, its daemon and queue, the pools,
one backfill of `responses` over B1..B8 launched through GraphQL as the UI launches it) and through the engine
alone.

The key is `tests.support.limited_provider.LimitedProvider` in its own process: an in-flight cap (or a
request-rate limit), answers of log-normal length (median 1,500 tokens, σ 0.8, capped at 8,192) decoded at
1,500 tokens/s per request after 0.04 s (a thinking model's pace at a fiftieth of its time), streamed in 16
events each. Each dataset has 2,500 prompts and a budget of 3M tokens (5,000 tokens per slot of the
600-request cap), so every budget binds before its prompts run out.

Figures, all from one run: wall time from the first run's start (and from the first request) against the key's
ideal, the total service time of the answers divided by the cap (or the answers divided by the rate); the mean
number of requests the provider held while work remained (until its last accepted request) as a share of the
cap; refused attempts; the largest budget overshoot; prompts lost (bought and not stored); and the fixed costs
from the launch to the first request, as the `responses` metadata reports them. With an in-flight cap, also
the blind floor: the same answers, in the order given, on the cap's slots kept full from the first request
(`list_schedule_s`), the best any client reaches that cannot know an answer's length before it ends; the wall
against it is the client's share of the gap to the ideal, the floor against the ideal is the heavy tail's.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from tests.support.limited_provider import LimitedProvider, ProviderSpec

REPO = Path(__file__).resolve().parent.parent
KEY_ENV = "BENCH_BACKFILL_KEY"
DATASETS = [f"B{i}" for i in range(1, 9)]
CAP = 600
RATE = 240.0  # requests/s: the same work as the cap takes at its mean service time (≈ 2.5 s)
BUDGET = 3_000_000
MAX_TOKENS = 8192
ANSWER = dict(
    median_tokens=1500, sigma=0.8, tokens_per_s=1500, base_s=0.04, latency_median_s=None, stream_chunks=16
)


def _project(root: Path, base_url: str, prompts: int) -> Path:
    (root / "prompts").mkdir(parents=True, exist_ok=True)
    datasets = {}
    for key in DATASETS:
        with open(root / "prompts" / f"{key}.jsonl", "w") as fh:
            for i in range(prompts):
                fh.write(
                    json.dumps(
                        {"id": f"{key}-{i:05d}", "messages": [{"role": "user", "content": f"{key} {i}"}]}
                    )
                    + "\n"
                )
        datasets[key] = {
            "source": f"prompts/{key}.jsonl",
            "format": "messages",
            "budget_tokens": BUDGET,
            "max_tokens": MAX_TOKENS,
        }
    cfg = {
        "storage": {"root": "data"},
        "backend": "openrouter",
        "backends": {
            "openrouter": {
                "base_url": base_url,
                "api_key_env": KEY_ENV,
                "model": "sim/model",
                "max_concurrency": 2000,
                "stream": True,
                "reasoning": None,
            }
        },
        "datasets": datasets,
        "pools": {"llm_api": 1, "gpu": 1},
    }
    path = root / "eagle3.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _ingest(config: Path) -> None:
    from eagle3_assets.config import load_config
    from eagle3_assets.core.prompts.ingest import write_prompts
    from eagle3_assets.core.storage.layout import DatasetLayout

    cfg = load_config(config)
    for key in DATASETS:
        layout = DatasetLayout(cfg.storage_root, key).ensure()
        write_prompts(cfg.resolve_path(cfg.datasets[key].source), layout, cfg.datasets[key])


def _sample(provider: LimitedProvider, until: threading.Event, out: list) -> None:
    while not until.is_set():
        s = provider.stats()
        out.append((s["now"], s["in_flight"]))
        time.sleep(0.1)


def _figures(stats: dict, samples: list, ideal: float, cap: float | None, root: Path) -> dict:
    import polars as pl

    start, end = stats["started_at"], max(stats["done_at"])
    busy_until = stats["last_accepted_at"]
    window = [f for t, f in samples if start <= t <= busy_until]
    stored, worst = 0, 0.0
    for key in DATASETS:
        folder = root / "data" / key / "responses"
        tokens = (
            int(pl.read_parquet(folder / "*.parquet")["completion_tokens"].sum())
            if any(folder.glob("*.parquet"))
            else 0
        )
        stored += tokens
        worst = max(worst, tokens / BUDGET)
    out = {
        "wall_from_first_request_s": round(end - start, 1),
        "ideal_s": round(ideal, 1),
        "vs_ideal_from_first_request": round((end - start) / ideal, 2),
        "refused_share": round(stats["refused"] / max(stats["attempts"], 1), 4),
        "worst_budget": round(worst, 4),
        "tokens_lost": stats["billed_tokens"] - stored,
        "answers": stats["answers"],
    }
    if cap:
        out["mean_in_flight_share_while_work_remains"] = round(sum(window) / max(len(window), 1) / cap, 2)
        floor = list_schedule_s(stats["service_times"], int(cap))
        out["blind_floor_s"] = round(floor, 2)
        out["blind_floor_vs_ideal"] = round(floor / ideal, 2)
        out["vs_blind_floor_from_first_request"] = round((end - start) / floor, 2)
    return out


def list_schedule_s(service_times: list[float], cap: int) -> float:
    """The makespan of the same answers, in the order the provider gave them, on `cap` slots kept full from
    the first request: what any client that cannot know an answer's length before it ends reaches at best. Its
    excess over the ideal is the structural tail (the last long answers land alone), not the client."""
    import heapq

    slots = [0.0] * max(cap, 1)
    for t in service_times:
        heapq.heapreplace(slots, slots[0] + t)
    return max(slots)


def _ideal(stats: dict, spec: ProviderSpec) -> float:
    if spec.max_in_flight:
        return stats["service_s"] / spec.max_in_flight
    return stats["answers"] / spec.rate


def engine_only(spec: ProviderSpec, prompts: int) -> dict:
    """generate_datasets over the eight datasets in this process: the engine without Dagster's fixed costs."""
    os.environ.setdefault(KEY_ENV, "bench-key-0123456789")
    from eagle3_assets.config import load_config
    from eagle3_assets.core.generation.run import DatasetJob, GenerationPlan, generate_datasets
    from eagle3_assets.core.storage.layout import DatasetLayout
    from resources import Inference, Target

    with tempfile.TemporaryDirectory() as tmp, LimitedProvider(spec, process=True) as provider:
        root = Path(tmp)
        config = _project(root, provider.base_url, prompts)
        _ingest(config)
        cfg = load_config(config)
        chat = Target(cfg).chat_tokenizer()
        inference = Inference(cfg)
        jobs = [
            DatasetJob(
                DatasetLayout(cfg.storage_root, k), GenerationPlan(k, cfg.dataset(k), cfg.sampling_for(k))
            )
            for k in DATASETS
        ]
        samples: list = []
        stop = threading.Event()
        threading.Thread(target=_sample, args=(provider, stop, samples), daemon=True).start()
        c0 = time.process_time()
        generate_datasets(
            jobs, inference.create_backend(chat), chat, inference.engine_settings(None), log=lambda m: None
        )
        cpu = time.process_time() - c0
        stop.set()
        stats = provider.stats()
        out = _figures(stats, samples, _ideal(stats, spec), spec.max_in_flight, root)
        out["client_cpu_s"] = round(cpu, 1)
    return out


def through_dagster(spec: ProviderSpec, prompts: int) -> dict:
    """`dagster dev` on a fresh DAGSTER_HOME prepared as `make instance` does; one backfill of `responses`
    over B1..B8 through GraphQL, executed by the daemon."""
    from tests.support.dagster_dev import DagsterDev

    os.environ.setdefault(KEY_ENV, "bench-key-0123456789")
    with tempfile.TemporaryDirectory() as tmp, LimitedProvider(spec, process=True) as provider:
        root = Path(tmp)
        config = _project(root, provider.base_url, prompts)
        _ingest(config)
        home = root / "dagster_home"
        home.mkdir()
        shutil.copy(REPO / "deploy" / "local" / "dagster.yaml", home / "dagster.yaml")
        subprocess.run(
            [sys.executable, "-m", "eagle3_assets.cli", "--config", str(config), "instance"],
            cwd=REPO, env={**os.environ, "DAGSTER_HOME": str(home)}, check=True, capture_output=True,
        )  # fmt: skip
        with DagsterDev(config, home, env={KEY_ENV: os.environ[KEY_ENV]}) as dev:
            samples: list = []
            stop = threading.Event()
            threading.Thread(target=_sample, args=(provider, stop, samples), daemon=True).start()
            launched = time.time()
            backfill = dev.launch_backfill(["responses"], DATASETS, title="bench backfill")
            result = dev.wait_backfill(backfill, timeout=1800)
            stop.set()
            stats = provider.stats()
            runs = _run_times(home, [r["id"] for r in result["runs"]])
            metadata = _responses_metadata(home)
        out = _figures(stats, samples, _ideal(stats, spec), spec.max_in_flight, root)
        first_start = min(r["start"] for r in runs)
        last_end = max(r["end"] for r in runs)
        to_wall = time.time() - time.monotonic()  # the provider stamps with the shared monotonic clock
        out.update(
            status=result["status"],
            runs=len(runs),
            wall_from_first_run_start_s=round(last_end - first_start, 1),
            vs_ideal_from_first_run_start=round((last_end - first_start) / out["ideal_s"], 2),
            vs_blind_floor_from_first_run_start=(
                round((last_end - first_start) / out["blind_floor_s"], 2) if "blind_floor_s" in out else None
            ),
            launch_to_first_run_start_s=round(first_start - launched, 1),
            run_start_to_first_request_s=round(stats["started_at"] + to_wall - first_start, 2),
            last_answer_to_run_end_s=round(last_end - (max(stats["done_at"]) + to_wall), 2),
            startup_s=metadata.get("startup_s"),
        )
    return out


def _run_times(home: Path, run_ids: list[str]) -> list[dict]:
    import dagster as dg

    os.environ["DAGSTER_HOME"] = str(home)
    with dg.DagsterInstance.get() as instance:
        out = []
        for rid in run_ids:
            rec = instance.get_run_record_by_id(rid)
            out.append({"start": rec.start_time, "end": rec.end_time})
        return out


def _responses_metadata(home: Path) -> dict:
    import dagster as dg

    with dg.DagsterInstance.get() as instance:
        event = instance.get_latest_materialization_event(dg.AssetKey("responses"))
        md = event.asset_materialization.metadata if event else {}
        return {k: v.value for k, v in md.items()}


def run(quick: bool = False) -> dict:
    prompts = 800 if quick else 2500
    budget_note = "" if not quick else " (quick: fewer prompts, budgets may not bind)"
    scenarios = {
        f"in flight ≤ {CAP}": ProviderSpec(max_in_flight=CAP, **ANSWER),
        f"{RATE:g} requests/s": ProviderSpec(rate=RATE, retry_after=1, **ANSWER),
    }
    results: dict = {}
    for name, spec in scenarios.items():
        for path, fn in (("engine alone", engine_only), ("dagster backfill", through_dagster)):
            r = fn(spec, prompts)
            results[f"{name} | {path}"] = r
            print(f"{name:<20} {path:<17} " + json.dumps(r) + budget_note, flush=True)
    return results


if __name__ == "__main__":
    import sys as _sys

    run(quick="--quick" in _sys.argv)
