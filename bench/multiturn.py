"""turns: all at scale: thousands of conversations as chains in one window, against the same number of
independent requests.

2,000 conversations of 4 turns (8,000 requests, each turn sent only after the previous answer landed) against
a loopback provider in its own process that holds at most 600 requests in flight, with heavy-tailed service
times (log-normal, median 1 s); beside it, the same 8,000 requests as independent single-turn prompts.
Head-of-line blocking would show as a lower mean in flight for the chains (slots idle while conversations wait
for their previous turn); the ratio of the two walls is what chaining costs.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from eagle3_assets.config import OpenRouterConfig
from eagle3_assets.core.generation.budget import Budget
from eagle3_assets.core.generation.conversations import Chain, Chains
from eagle3_assets.core.generation.engine import GenerationEngine
from eagle3_assets.core.generation.engine_settings import EngineSettings
from eagle3_assets.core.generation.journal import JournalWriter, ResponseJournal
from eagle3_assets.core.generation.lanes import Lane
from eagle3_assets.core.generation.protocol import CompletionRequest, Sampling
from eagle3_assets.core.generation.stopping import run_loop
from eagle3_assets.core.storage.layout import DatasetLayout
from resources.inference.openrouter import OpenRouterBackend
from tests.support.engine_runs import shipped_target_tokenizer
from tests.support.limited_provider import LimitedProvider, ProviderSpec

CAP = 600


def conversation(i: int, turns: int) -> list[dict]:
    msgs: list[dict] = []
    for k in range(1, turns + 1):
        msgs.append({"role": "user", "content": f"conversation {i} question {k}"})
        if k < turns:
            msgs.append({"role": "assistant", "content": "source answer"})
    return msgs


async def _run(url: str, n: int, turns: int, chained: bool) -> dict:
    backend = OpenRouterBackend(
        OpenRouterConfig(base_url=url, api_key_env="NONE", max_concurrency=2000, stream=False),
        shipped_target_tokenizer(),
    )
    with tempfile.TemporaryDirectory() as tmp:
        writer = JournalWriter(ResponseJournal(DatasetLayout(Path(tmp), "bench")), "openrouter", "bench")
        engine = GenerationEngine(
            backend, EngineSettings(max_concurrency=2000, progress_interval_s=3600), lambda m: None
        )
        budget = Budget(4096, 10**12)
        if chained:
            chains = Chains(
                [Chain(f"c{i}", conversation(i, turns)) for i in range(n)],
                4096,
                Sampling(),
                None,
                lambda *a: None,
            )
            lane = Lane("bench", chains.first_requests(), n, budget, writer, follow=chains.follow)
        else:
            requests = (
                CompletionRequest(
                    f"p{i}-{k}", [{"role": "user", "content": f"conversation {i} question {k}"}], 4096
                )
                for i in range(n)
                for k in range(1, turns + 1)
            )
            lane = Lane("bench", requests, n * turns, budget, writer)
        await backend.start()
        try:
            (report,) = await engine.run([lane])
        finally:
            await backend.close()
    return {"answered": report.succeeded, "refused": report.refused, "attempts": report.attempts}


def measure(n: int, turns: int, chained: bool) -> dict:
    spec = ProviderSpec(
        max_in_flight=CAP, in_flight_retry_after=None, latency_median_s=1.0, latency_sigma=0.6
    )
    with LimitedProvider(spec, process=True) as provider:
        t0 = time.monotonic()
        out = run_loop(_run(provider.base_url, n, turns, chained))
        s = provider.stats()
        wall = time.monotonic() - t0
    out.update(
        wall_s=wall,
        mean_in_flight=s["in_flight_area"] / max(time.monotonic() - s["started_at"], 1e-9),
        ideal_s=s["service_s"] / CAP,
    )
    return out


def run(quick: bool = False) -> dict:
    n, turns = (400, 4) if quick else (2000, 4)
    result = {}
    for chained in (False, True):
        r = measure(n, turns, chained)
        name = "chains" if chained else "independent"
        result[name] = r
        print(
            f"{name:12s} {r['answered']:,} answers: wall {r['wall_s']:.1f} s = "
            f"{r['wall_s'] / r['ideal_s']:.2f}x the ideal, mean in flight {r['mean_in_flight']:.0f} = "
            f"{r['mean_in_flight'] / CAP:.2f} of the cap, refused {r['refused'] / max(r['attempts'], 1):.1%}",
            flush=True,
        )
    return result
