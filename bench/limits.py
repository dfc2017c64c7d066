"""Riding provider limits: goodput as a share of the limit and refused attempts as a share of all attempts,
for this engine beside today's fixed-concurrency policy and a client that pauses 10 s after each 429; the
random fault mix against its fault-free time; faults scripted on first attempts (no limit behind them) against
the same run without them; budget overshoot at 500 and 2000 in flight; client CPU of 2000 streams.

Every provider is `tests.support.limited_provider.LimitedProvider` in its own process (so the client's CPU is
its own), with heavy-tailed service times (log-normal, median 1 s). Goodput is counted by the provider between
the 10% and 90% quantiles of answers (ramp-up and drain left out); whole-run figures are printed beside it.
Baselines that do not finish are stopped at a deadline and their unanswered prompts counted.
"""

from __future__ import annotations

import math
import os
import tempfile
import threading
import time
from pathlib import Path

from eagle3_assets.config import OpenRouterConfig
from eagle3_assets.core.generation.budget import Budget
from eagle3_assets.core.generation.engine import GenerationEngine
from eagle3_assets.core.generation.engine_settings import EngineSettings
from eagle3_assets.core.generation.journal import JournalWriter, ResponseJournal
from eagle3_assets.core.generation.lanes import Lane
from eagle3_assets.core.generation.protocol import CompletionRequest
from eagle3_assets.core.generation.stopping import run_loop
from eagle3_assets.core.storage.layout import DatasetLayout
from resources.inference.openrouter import OpenRouterBackend
from tests.support.engine_runs import shipped_target_tokenizer
from tests.support.fake_servers import FakeOpenRouter, scripted_fault_prompts
from tests.support.limited_provider import LimitedProvider, ProviderSpec, goodput

from .baselines import run_fixed

KEY_ENV = "BENCH_LIMITS_KEY"
CEILING = 2000
LATENCY = dict(latency_median_s=1.0, latency_sigma=0.6)
MEAN_LATENCY = math.exp(0.6**2 / 2)  # of a log-normal with median 1 s


def _backend(url: str, stream: bool = False):
    os.environ.setdefault(KEY_ENV, "bench-key-0123456789")
    return OpenRouterBackend(
        OpenRouterConfig(
            base_url=url,
            api_key_env=KEY_ENV,
            model="sim/model",
            stream=stream,
            reasoning=None,
            request_timeout_s=300,
        ),
        shipped_target_tokenizer(),
    )


def _requests(n: int, max_tokens: int, tag: str):
    return (
        CompletionRequest(f"{tag}{i}", [{"role": "user", "content": f"{tag} {i}"}], max_tokens)
        for i in range(n)
    )


async def _engine(
    url: str, n: int, *, stream=False, budget_tokens=10**12, max_tokens=4096, ceiling=CEILING, tag="p"
):
    backend = _backend(url, stream)
    with tempfile.TemporaryDirectory() as tmp:
        writer = JournalWriter(ResponseJournal(DatasetLayout(Path(tmp), "bench")), "openrouter", "bench")
        engine = GenerationEngine(
            backend, EngineSettings(max_concurrency=ceiling, progress_interval_s=3600), log=lambda m: None
        )
        lane = Lane("bench", _requests(n, max_tokens, tag), n, Budget(max_tokens, budget_tokens), writer)
        await backend.start()
        try:
            (report,) = await engine.run([lane])
        finally:
            await backend.close()
    return {"answered": report.succeeded, "attempts": report.attempts, "refused": report.refused}


async def _baseline(url: str, n: int, policy: str, deadline_s: float):
    backend = _backend(url)
    await backend.start()
    try:
        r = await run_fixed(
            backend,
            _requests(n, 4096, "p"),
            CEILING,
            pause_on_429_s=10.0 if policy == "pause10" else None,
            deadline_s=deadline_s,
        )
    finally:
        await backend.close()
    return {"answered": r.succeeded, "attempts": r.attempts, "refused": r.refused}


def _measure(spec: ProviderSpec, client: str, n: int, deadline_s: float) -> dict:
    with LimitedProvider(spec, process=True) as provider:
        t0, c0 = time.perf_counter(), time.process_time()
        if client == "engine":
            out = run_loop(_engine(provider.base_url, n))
        else:
            out = run_loop(_baseline(provider.base_url, n, client, deadline_s))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        stats = provider.stats()
    out.update(
        wall_s=round(wall, 1),
        unanswered=n - out["answered"],
        refused_share=round(out["refused"] / max(out["attempts"], 1), 4),
        steady_goodput=round(goodput(stats["done_at"]), 1),
        whole_goodput=round(out["answered"] / wall, 1),
        client_cpu_s=round(cpu, 1),
    )
    return out


def limits(quick: bool) -> dict:
    n = 3000 if quick else 9000
    deadline = 60.0 if quick else 120.0
    scenarios = {
        "rate 300/s (429, Retry-After 1)": (ProviderSpec(rate=300, retry_after=1, **LATENCY), 300.0),
        "in flight ≤ 400 (429)": (ProviderSpec(max_in_flight=400, **LATENCY), 400 / MEAN_LATENCY),
    }
    results: dict = {}
    for name, (spec, capacity) in scenarios.items():
        for client in ("engine", "fixed", "pause10"):
            r = _measure(spec, client, n, deadline)
            r["goodput_share"] = round(r["steady_goodput"] / capacity, 3)
            results[f"{name} | {client}"] = r
            print(
                f"{name:<32} {client:<8} goodput {r['steady_goodput']:>7.1f}/s = {r['goodput_share']:.2f} of "
                f"the limit, refused {r['refused_share']:.1%}, unanswered {r['unanswered']}, wall "
                f"{r['wall_s']} s",
                flush=True,
            )
    return results


def fault_mix(quick: bool) -> dict:
    n = 3000 if quick else 9000
    mix = {"429": 0.12, "500": 0.02, "502": 0.02, "reset": 0.02, "malformed": 0.02}
    clean = _measure(ProviderSpec(**LATENCY), "engine", n, 300)
    deadline = 90.0 if quick else 150.0
    out = {"fault_free": clean}
    for client in ("engine", "fixed", "pause10"):
        r = _measure(ProviderSpec(fault_mix=mix, **LATENCY), client, n, deadline)
        r["vs_fault_free"] = round(r["wall_s"] / clean["wall_s"], 2)
        out[client] = r
        print(
            f"fault mix (12% 429, 8% 5xx/reset/malformed) {client:<8} {r['wall_s']:>6} s = "
            f"{r['vs_fault_free']:.2f}× the fault-free {clean['wall_s']} s, unanswered {r['unanswered']}",
            flush=True,
        )
    return out


async def _scripted_engine(url: str, texts: list[str], ceiling: int):
    backend = _backend(url)
    reqs = (CompletionRequest(f"p{i}", [{"role": "user", "content": t}], 256) for i, t in enumerate(texts))
    settings = EngineSettings(
        max_concurrency=ceiling, progress_interval_s=3600, backoff_base_s=0.1, backoff_max_s=2.0
    )
    with tempfile.TemporaryDirectory() as tmp:
        writer = JournalWriter(ResponseJournal(DatasetLayout(Path(tmp), "bench")), "openrouter", "bench")
        engine = GenerationEngine(backend, settings, log=lambda m: None)
        await backend.start()
        try:
            (report,) = await engine.run([Lane("bench", reqs, len(texts), Budget(256, 10**12), writer)])
        finally:
            await backend.close()
    return report


def first_attempt_faults(quick: bool) -> dict:
    """Mixed faults (429 with and without Retry-After, 5xx, resets, errors in 200 bodies, malformed answers)
    on the first one to three attempts of 30% of the prompts, with no limit behind them: the run against the
    same run without faults (the window must not read the noise as a limit)."""
    n, ceiling = (3000, 300) if quick else (12000, 600)
    out: dict = {}
    for share in (0.0, 0.3):
        with FakeOpenRouter(latency=0.1) as server:
            t0 = time.perf_counter()
            r = run_loop(_scripted_engine(server.base_url, scripted_fault_prompts(n, share, seed=1), ceiling))
            wall = time.perf_counter() - t0
        out[f"share {share}"] = {
            "wall_s": round(wall, 2),
            "answered": r.succeeded,
            "refused_share": round(r.refused_share, 4),
            "window_min": r.limit_min,
            "window_decreases": r.limit_decreases,
        }
    out["vs_fault_free"] = round(out["share 0.3"]["wall_s"] / out["share 0.0"]["wall_s"], 2)
    print(
        f"first-attempt faults on 30% of {n} prompts, ceiling {ceiling}: {out['share 0.3']['wall_s']} s = "
        f"{out['vs_fault_free']}x the fault-free {out['share 0.0']['wall_s']} s; window min "
        f"{out['share 0.3']['window_min']}, {out['share 0.3']['window_decreases']} decreases",
        flush=True,
    )
    return out


def _sample_in_background(provider: LimitedProvider) -> tuple[list[tuple[int, int]], threading.Event]:
    """(billed tokens, requests in flight) as the provider sees them, every 0.1 s until the event is set."""
    samples: list[tuple[int, int]] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            s = provider.stats()
            samples.append((s["billed_tokens"], s["in_flight"]))
            time.sleep(0.1)

    threading.Thread(target=sample, daemon=True).start()
    return samples, done


def budget(quick: bool) -> dict:
    """Log-normal lengths (median 400, σ 1, cap 4096), latency 0.2 s + tokens / 800 per second."""
    spec = ProviderSpec(median_tokens=400, sigma=1.0, tokens_per_s=800, base_s=0.2, latency_median_s=None)
    cases = [(500, 1_500_000, True), (2000, 6_000_000, False)]
    if quick:
        cases = [(500, 1_500_000, True)]
    out = {}
    for ceiling, limit, stream in cases:
        with LimitedProvider(spec, process=True) as provider:
            samples, done = _sample_in_background(provider)
            run_loop(_engine(provider.base_url, 200_000, stream=stream, budget_tokens=limit, ceiling=ceiling))
            done.set()
            billed = provider.stats()["billed_tokens"]
        early = [f for b, f in samples if 0.1 * limit <= b <= 0.8 * limit]
        r = {
            "bought_over_budget": round(billed / limit, 4),
            "in_flight_share_until_80pct": round(sum(early) / max(len(early), 1) / ceiling, 2),
            "streaming": stream,
        }
        out[f"{ceiling} in flight"] = r
        print(
            f"budget {limit:,} tokens at {ceiling} in flight ({'streaming' if stream else 'not streaming'}): "
            f"bought {r['bought_over_budget']:.4f}× the budget; mean in flight while 10-80% of it was "
            f"bought: {r['in_flight_share_until_80pct']:.2f} of {ceiling}",
            flush=True,
        )
    return out


def streaming_cpu(quick: bool) -> dict:
    """Client CPU per streamed event: 2000 concurrent streams of 256 events over ~8 s each (32 events/s per
    stream, a thinking model's pace; 64,000 events/s in all), each event in its own TCP segment as providers
    send them, from `event_server.EventServer` (a server lean enough to keep that pace; how late it fell is
    reported), against the same answers unstreamed; the engine beside a minimal aiohttp streaming client that
    reads each chunk as it comes and parses every event, on the same loop. Providers send about one token per
    event, so events/s is tokens/s."""
    from .engine_throughput import _minimal_streaming_client, _plain_aiohttp_client
    from .event_server import EventServer

    n = 4000 if quick else 6000
    events = 256

    async def engine(url: str, stream: bool) -> None:
        await _engine(url, n, stream=stream, tag="s")

    async def minimal(url: str, stream: bool) -> None:
        client = _minimal_streaming_client if stream else _plain_aiohttp_client
        await client(url, n, 2000, [])

    out: dict = {}
    for name, client in (("engine", engine), ("minimal aiohttp", minimal)):
        per = {}
        for stream in (False, True):
            with EventServer(events=events, median_s=8.0, sigma=0.2) as server:
                c0, t0, s0 = time.process_time(), time.perf_counter(), server.cpu_seconds()
                run_loop(client(server.base_url, stream))
                cpu, wall = time.process_time() - c0, time.perf_counter() - t0
                server_cpu, sent = server.cpu_seconds() - s0, server.stats()
            per["streaming" if stream else "plain"] = {
                "client_cpu_ms_per_answer": round(1000 * cpu / n, 3),
                "client_core_share": round(cpu / wall, 2),
                "server_core_share": round(server_cpu / wall, 2),
                "server_mean_lag_ms": round(1000 * sent.get("mean_lag_s", float("nan")), 1),
            }
        s_, p_ = per["streaming"], per["plain"]
        per["us_per_event"] = round(
            1000 * (s_["client_cpu_ms_per_answer"] - p_["client_cpu_ms_per_answer"]) / events, 2
        )
        out[name] = per
        print(
            f"{name:<16} 2000 streams of {events} events: {s_['client_cpu_ms_per_answer']} ms client CPU per "
            f"answer against {p_['client_cpu_ms_per_answer']} ms unstreamed: {per['us_per_event']} µs per "
            f"event (one core follows {1e6 / max(per['us_per_event'], 1e-9):,.0f} streamed tokens/s; the "
            f"server {s_['server_mean_lag_ms']} ms late on average)",
            flush=True,
        )
    out["engine_vs_minimal"] = round(
        out["engine"]["us_per_event"] / out["minimal aiohttp"]["us_per_event"], 3
    )
    return out


def run(quick: bool = False) -> dict:
    return {
        "limits": limits(quick),
        "fault_mix": fault_mix(quick),
        "first_attempt_faults": first_attempt_faults(quick),
        "budget": budget(quick),
        "streaming_cpu": streaming_cpu(quick),
    }
