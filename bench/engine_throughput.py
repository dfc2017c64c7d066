"""Engine throughput at 256/1000/2000 concurrent requests against one loopback server with 1 s latency.

Compared, in the same run against the same server: the generation engine (aiohttp, one session, journal writes
included), a plain `openai.AsyncOpenAI` client behind an `asyncio.Semaphore`, and the ideal (concurrency /
latency). Steady requests/s is counted over the middle waves (the first wave's connection set-up and the last
wave's drain excluded); CPU per request is the client process's CPU time over the requests it completed.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import openai

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

from .loopback import EVENTS, LoopbackServer

LATENCY_S = 1.0
WAVES = 5
MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


def _steady_rate(done_at: list[float], concurrency: int) -> float:
    """Requests/s of the middle waves: from the c-th completion to the (n-c)-th (start-up and drain
    excluded)."""
    xs = sorted(done_at)
    if len(xs) <= 2 * concurrency:
        return len(xs) / (xs[-1] - xs[0]) if len(xs) > 1 else 0.0
    lo, hi = xs[concurrency - 1], xs[len(xs) - concurrency - 1]
    return (len(xs) - 2 * concurrency) / (hi - lo)


async def _engine_client(
    base_url: str, n: int, concurrency: int, done_at: list[float], stream: bool = False
) -> int:
    os.environ.setdefault("BENCH_KEY", "bench")
    backend = OpenRouterBackend(
        OpenRouterConfig(base_url=base_url, api_key_env="BENCH_KEY", model="bench/model", stream=stream),
        shipped_target_tokenizer(),
    )
    inner = backend.complete

    async def timed(request):
        c = await inner(request)
        done_at.append(time.perf_counter())
        return c

    backend.complete = timed
    with tempfile.TemporaryDirectory() as tmp:
        writer = JournalWriter(ResponseJournal(DatasetLayout(Path(tmp), "bench")), "openrouter", "bench")
        engine = GenerationEngine(
            backend,
            EngineSettings(max_concurrency=concurrency, max_retries=0, progress_interval_s=3600),
            log=lambda m: None,
        )
        requests = (CompletionRequest(f"r{i}", MESSAGES, 64) for i in range(n))
        lane = Lane("bench", requests, n, Budget(64, 10**12), writer)
        await backend.start()
        try:
            (report,) = await engine.run([lane])
        finally:
            await backend.close()
    return report.succeeded


async def _openai_client(base_url: str, n: int, concurrency: int, done_at: list[float]) -> int:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0, timeout=120)
    sem = asyncio.Semaphore(concurrency)
    ok = 0

    async def one() -> None:
        nonlocal ok
        async with sem:
            try:
                await client.chat.completions.create(model="bench/model", messages=MESSAGES, max_tokens=64)
            except Exception:
                return
            ok += 1
            done_at.append(time.perf_counter())

    await asyncio.gather(*(one() for _ in range(n)))
    await client.close()
    return ok


async def _engine_streaming(base_url: str, n: int, concurrency: int, done_at: list[float]) -> int:
    return await _engine_client(base_url, n, concurrency, done_at, stream=True)


async def _minimal_streaming_client(base_url: str, n: int, concurrency: int, done_at: list[float]) -> int:
    """A minimal streaming client: bare aiohttp, each chunk read as it comes, every event parsed, the content
    joined; no retries, no bookkeeping."""
    import aiohttp
    import orjson

    body = orjson.dumps({"model": "bench/model", "messages": MESSAGES, "max_tokens": 64, "stream": True})
    ok = 0
    remaining = iter(range(n))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            nonlocal ok
            for _ in remaining:
                async with session.post(
                    f"{base_url}/chat/completions", data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    buf, parts = b"", []
                    while chunk := await resp.content.readany():
                        buf += chunk
                        *lines, buf = buf.split(b"\n")
                        for line in lines:
                            if line.startswith(b"data: ") and line != b"data: [DONE]":
                                choices = orjson.loads(line[6:]).get("choices") or [{}]
                                parts.append((choices[0].get("delta") or {}).get("content") or "")
                    "".join(parts)
                ok += 1
                done_at.append(time.perf_counter())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok


async def _plain_aiohttp_client(base_url: str, n: int, concurrency: int, done_at: list[float]) -> int:
    """The transport's own ceiling: bare aiohttp, one session, no retries, no bookkeeping."""
    import aiohttp
    import orjson

    body = orjson.dumps({"model": "bench/model", "messages": MESSAGES, "max_tokens": 64})
    ok = 0
    remaining = iter(range(n))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:

        async def worker() -> None:
            nonlocal ok
            for _ in remaining:
                async with session.post(
                    f"{base_url}/chat/completions", data=body, headers={"Content-Type": "application/json"}
                ) as resp:
                    orjson.loads(await resp.read())
                ok += 1
                done_at.append(time.perf_counter())

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok


def _measure(client: Callable[..., Awaitable[int]], server: LoopbackServer, concurrency: int, n: int) -> dict:
    done_at: list[float] = []
    server_cpu0 = server.cpu_seconds()
    cpu0, t0 = time.process_time(), time.perf_counter()
    ok = _run_loop(client(server.base_url, n, concurrency, done_at))
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    return {
        "ok": ok,
        "failed": n - ok,
        "wall_s": round(wall, 2),
        "steady_rps": round(_steady_rate(done_at, concurrency), 1),
        "cpu_ms_per_request": round(1000 * cpu / max(ok, 1), 3),
        "client_core_share": round(cpu / wall, 2),
        "server_core_share": round((server.cpu_seconds() - server_cpu0) / wall, 2),
    }


def resume_check_seconds(n: int = 100_000) -> float:
    """Seconds to re-materialise a finished n-prompt partition (reads what is done, sends nothing)."""
    from eagle3_assets.core.generation.run import generate_responses
    from tests.support.engine_runs import NeverCalledBackend, make_plan, write_finished_partition

    with tempfile.TemporaryDirectory() as tmp:
        layout = write_finished_partition(Path(tmp), n)
        t0 = time.perf_counter()
        generate_responses(
            layout,
            make_plan("B9", 100, 10**12),
            NeverCalledBackend(),
            None,
            EngineSettings(max_concurrency=8),
            log=lambda m: None,
        )
        return time.perf_counter() - t0


def run(quick: bool = False) -> dict:
    levels = [256, 1000] if quick else [256, 1000, 2000]
    results: dict = {"latency_s": LATENCY_S, "loop": "uvloop (the engine's)", "levels": {}}
    with LoopbackServer(LATENCY_S) as server:
        for c in levels:
            n = c * (3 if quick else WAVES)
            results["levels"][c] = {
                "engine": _measure(_engine_client, server, c, n),
                "openai_semaphore": _measure(_openai_client, server, c, n),
                "plain_aiohttp": _measure(_plain_aiohttp_client, server, c, n),
                "engine_streamed": _measure(_engine_streaming, server, c, n),
                "minimal_streaming": _measure(_minimal_streaming_client, server, c, n),
                "ideal_rps": c / LATENCY_S,
            }
    print(
        "requests/s (steady) and client CPU per request; ratios against the ideal (concurrency / latency), "
        "the"
    )
    print(
        "openai SDK + semaphore, bare aiohttp (the transport's ceiling on this machine), and, streamed "
        f"({EVENTS} events per answer), a minimal aiohttp streaming client; every client on the same loop"
    )
    print(
        f"{'conc.':>5} {'engine':>7} {'openai':>7} {'aiohttp':>7} {'ideal':>6} | {'eng/ideal':>9} "
        f"{'eng/openai':>10} {'eng/aiohttp':>11} | {'cpu ms/req eng':>14} {'openai':>6} {'aiohttp':>7} | "
        f"{'streamed eng':>12} {'minimal':>7} {'ratio':>5} {'cpu ms eng/min':>14}"
    )
    for c, r in results["levels"].items():
        e, o, a = r["engine"], r["openai_semaphore"], r["plain_aiohttp"]
        se, sm = r["engine_streamed"], r["minimal_streaming"]
        print(
            f"{c:>5} {e['steady_rps']:>7.0f} {o['steady_rps']:>7.0f} {a['steady_rps']:>7.0f} "
            f"{r['ideal_rps']:>6.0f} | {e['steady_rps'] / r['ideal_rps']:>9.2f} "
            f"{e['steady_rps'] / max(o['steady_rps'], 1e-9):>10.2f} "
            f"{e['steady_rps'] / max(a['steady_rps'], 1e-9):>11.2f} | {e['cpu_ms_per_request']:>14.3f} "
            f"{o['cpu_ms_per_request']:>6.3f} {a['cpu_ms_per_request']:>7.3f} | {se['steady_rps']:>12.0f} "
            f"{sm['steady_rps']:>7.0f} {se['steady_rps'] / max(sm['steady_rps'], 1e-9):>5.2f} "
            f"{se['cpu_ms_per_request']:>6.3f}/{sm['cpu_ms_per_request']:<6.3f}"
        )
    results["resume_finished_100k_s"] = round(resume_check_seconds(), 2)
    print(
        "re-materialising a finished 100k-prompt partition: "
        f"{results['resume_finished_100k_s']} s, nothing sent"
    )
    return results


def _run_loop(coro):
    """Every client on the engine's own loop (uvloop where installed), so the comparison is of the clients."""
    return run_loop(coro)
