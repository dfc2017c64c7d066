"""Storage at scale: a generated partition of N answered prompts (~10 KB of content plus reasoning each),
built in full, then topped up with 1,000 more answers; every stage but hidden states (a GPU stage: hours on
this CPU) runs in its own process, so its peak RSS is its own. Once with a local root, once with an S3 root on
a loopback S3-compatible server (moto's server mode), where each stage pulls what it reads and pushes what it
writes.

`python -m bench storage` (N = 200,000; BENCH_STORAGE_ROWS overrides; `--quick`: 20,000).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
import polars as pl

REPO = Path(__file__).resolve().parent.parent
TOP_UP = 1000
WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "this",
    "are",
    "from",
    "at",
    "or",
    "an",
    "which",
    "but",
    "not",
    "have",
    "all",
    "can",
    "model",
    "token",
    "answer",
    "reason",
    "step",
    "first",
    "then",
    "because",
    "value",
    "function",
    "return",
    "list",
    "number",
    "string",
    "data",
    "train",
    "speculative",
    "decoding",
    "draft",
    "target",
    "layer",
    "hidden",
    "state",
    "attention",
    "cache",
    "budget",
    "provider",
    "request",
]


def _text(rng: np.random.Generator, n_bytes: int) -> str:
    words = rng.choice(WORDS, size=max(1, n_bytes // 6))
    return " ".join(words)[:n_bytes]


def make_project(folder: Path, n: int, root: str, options: dict | None = None) -> Path:
    """A config with one dataset of n + TOP_UP prompts (the last TOP_UP unanswered) and n answers stored."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True, exist_ok=True)
    src = folder / "B1.jsonl"
    with open(src, "w") as fh:
        for i in range(n + TOP_UP):
            fh.write(
                json.dumps(
                    {
                        "id": f"p{i:07d}",
                        "messages": [{"role": "user", "content": f"Question {i}: " + _text(rng, 200)}],
                    }
                )
                + "\n"
            )
    cfg = {
        "storage": {
            "root": root,
            **({"options": options, "cache_dir": str(folder / "cache")} if options else {}),
        },
        "backend": "openrouter",
        "datasets": {
            "B1": {"source": str(src), "format": "messages", "max_tokens": 4096, "budget_tokens": 10**12}
        },
    }
    path = folder / "eagle3.yaml"
    path.write_text(json.dumps(cfg))
    return path


def seed_answers(path: Path, n: int) -> None:
    """n answers written straight into the journal (as a long generation run leaves them)."""
    sys.path.insert(0, str(REPO))
    from eagle3_assets.config import load_config
    from eagle3_assets.core.prompts.ingest import write_prompts
    from eagle3_assets.core.storage.tables import RESPONSE_SCHEMA, JournalTable
    from resources import Storage

    cfg = load_config(path)
    storage = Storage(cfg)
    with storage.stage("B1", "prompts") as layout:
        write_prompts(cfg.resolve_path(cfg.datasets["B1"].source), layout, cfg.datasets["B1"])
    with storage.stage("B1", "responses", append_only=True) as layout:
        rng = np.random.default_rng(1)
        ids = pl.read_parquet(layout.prompts, columns=["id"])["id"].to_list()[:n]
        for start in range(0, n, 20_000):
            part = ids[start : start + 20_000]
            cols = {k: [None] * len(part) for k in RESPONSE_SCHEMA}
            cols.update(
                id=part,
                backend=["openrouter"] * len(part),
                model=["m"] * len(part),
                content=[_text(rng, 7000) for _ in part],
                reasoning=[_text(rng, 3000) for _ in part],
                finish_reason=["stop"] * len(part),
                completion_tokens=[2500] * len(part),
                prompt_tokens=[60] * len(part),
                latency_s=[30.0] * len(part),
                run_id=["seed"] * len(part),
            )
            JournalTable(layout.responses_dir, RESPONSE_SCHEMA).append(
                pl.DataFrame(cols, schema=RESPONSE_SCHEMA)
            )


STAGE = r"""
import sys, time, json, resource
sys.path.insert(0, {repo!r})
from eagle3_assets.config import load_config
from eagle3_assets.definitions import build_runtime
cfg = load_config({path!r}); rt = build_runtime(cfg, {path!r}); storage = rt["storage"]
stage = {stage!r}
t0 = time.perf_counter()
if stage == "responses":
    import asyncio
    from eagle3_assets.core.generation.engine_settings import EngineSettings
    from eagle3_assets.core.generation.run import GenerationPlan, generate_responses
    from bench.storage import FastBackend
    plan = GenerationPlan("B1", cfg.datasets["B1"], cfg.sampling, limit={limit})
    with storage.stage("B1", "responses", append_only=True) as layout:
        settings = EngineSettings(max_concurrency=256, progress_interval_s=3600)
        generate_responses(layout, plan, FastBackend(), None, settings,
                           log=lambda m: None, lock=storage.lock("B1"), on_flush=storage.flusher("B1"))
elif stage == "tokens":
    from eagle3_assets.core.tokens.build import build_tokens
    with storage.stage("B1", "tokens") as layout:
        s = build_tokens(layout, rt["target"].chat_tokenizer(), log=lambda m: None)
elif stage == "validation_report":
    from eagle3_assets.core.report.summary import write_report
    with storage.stage("B1", "validation_report") as layout:
        write_report(layout, cfg.datasets["B1"])
rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps({{"seconds": time.perf_counter() - t0, "max_rss_mb": rss_mb}}))
"""


class FastBackend:
    """Answers at once with ~10 KB of text: what is timed is the platform, not a model."""

    name = "openrouter"
    model = "bench"
    wants_prompt_ids = False
    served = None  # timed is the platform's storage, not what it accepts

    def __init__(self) -> None:
        self.rng = np.random.default_rng(2)

    async def start(self) -> None: ...

    async def preflight(self) -> list[str]:
        return []

    async def complete(self, request):
        from eagle3_assets.core.generation.protocol import Completion

        return Completion(
            content=_text(self.rng, 7000),
            reasoning=_text(self.rng, 3000),
            finish_reason="stop",
            prompt_tokens=60,
            completion_tokens=2500,
            model="bench",
            latency_s=0.01,
        )

    async def close(self) -> None: ...


def run_stage(path: Path, stage: str, limit: int | None = None) -> dict:
    code = STAGE.format(repo=str(REPO), path=str(path), stage=stage, limit=limit)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=os.environ
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def build_and_top_up(path: Path, n: int) -> dict:
    full = {s: run_stage(path, s) for s in ("tokens", "validation_report")}
    top = {"responses": run_stage(path, "responses", limit=TOP_UP)}
    top.update({s: run_stage(path, s) for s in ("tokens", "validation_report")})
    return {"full": full, "top_up": top}


def _moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(100):
        try:
            urllib.request.urlopen(url, timeout=2)
            break
        except OSError:
            time.sleep(0.3)
    urllib.request.urlopen(urllib.request.Request(f"{url}/eagle3-bench", method="PUT"), timeout=10)
    return proc, url


def run(quick: bool = False) -> dict:
    n = int(os.environ.get("BENCH_STORAGE_ROWS", 20_000 if quick else 200_000))
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    results: dict = {"rows": n, "top_up": TOP_UP}
    proc, url = _moto()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for kind in ("local", "s3"):
                folder = Path(tmp) / kind
                if kind == "local":
                    path = make_project(folder, n, str(folder / "data"))
                else:
                    path = make_project(
                        folder,
                        n,
                        "s3://eagle3-bench/run",
                        {"endpoint": url, "region": "us-east-1", "allow_http": True},
                    )
                t0 = time.perf_counter()
                seed_answers(path, n)
                seeded = time.perf_counter() - t0
                r = build_and_top_up(path, n)
                r["seed_s"] = round(seeded, 1)
                results[kind] = r
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        proc.terminate()
    print(
        f"{n:,} answered prompts (~10 KB each), then a top-up of {TOP_UP:,}; seconds and peak RSS per stage"
    )
    print(
        f"{'root':6} {'stage':18} {'full s':>8} {'top-up s':>9} {'top-up/full':>11} {'full MB':>8} "
        f"{'top-up MB':>9}"
    )
    for kind in ("local", "s3"):
        r = results[kind]
        for stage in ("tokens", "validation_report"):
            f, t = r["full"][stage], r["top_up"][stage]
            print(
                f"{kind:6} {stage:18} {f['seconds']:>8.1f} {t['seconds']:>9.1f} "
                f"{t['seconds'] / f['seconds']:>11.2f} {f['max_rss_mb']:>8.0f} {t['max_rss_mb']:>9.0f}"
            )
        resp = r["top_up"]["responses"]
        print(
            f"{kind:6} {'responses (+1000)':18} {'':>8} {resp['seconds']:>9.1f} {'':>11} {'':>8} "
            f"{resp['max_rss_mb']:>9.0f}"
        )
        full_total = sum(r["full"][s]["seconds"] for s in ("tokens", "validation_report"))
        top_total = sum(r["top_up"][s]["seconds"] for s in r["top_up"])
        r["top_up_share"] = top_total / full_total
        print(f"{kind:6} top-up of every stage / full build: {r['top_up_share']:.3f}")
    return results
