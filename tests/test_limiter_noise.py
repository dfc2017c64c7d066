"""Noise is not a limit: refusals whose share does not grow with the load (an upstream provider's own capacity
behind a router, 5xx and resets beside them) leave the window near the ceiling, while a real in-flight cap and
a real request-rate bucket still pull it to the limit.

The control law is driven on a fake clock by a small event simulation of the engine (due retries first, then
new prompts, while the window has room) against a simulated provider; one test runs the real engine on the
virtual clock of `test_limits` (`run_virtual`). Every assertion is on behaviour (the window, what was in
flight, what was refused), none on elapsed time.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

import pytest

from eagle3_assets.core.generation.limiter import AdaptiveLimit


@dataclass
class Provider:
    """What the simulated provider enforces. `noise`: the share of attempts refused whatever the load;
    `script`: per prompt, the faults of its first attempts ("429" a refusal, "5xx" a fault that tells nothing
    of capacity)."""

    cap: int | None = None
    rate: float | None = None
    burst: float | None = None
    noise: float = 0.0
    script: dict[int, list[str]] = field(default_factory=dict)
    in_flight: int = 0
    tokens: float = 0.0
    refilled_at: float = 0.0


@dataclass
class Run:
    limiter: AdaptiveLimit
    answered: int
    attempts: int
    refused: int
    end: float
    provider_max_in_flight: int
    samples: list[tuple[float, int]]  # (time, window), every 0.1 s

    @property
    def refused_share(self) -> float:
        return self.refused / self.attempts

    def windows_between(self, t0: float, t1: float) -> list[int]:
        return [w for t, w in self.samples if t0 <= t <= t1]


def simulate(
    provider: Provider,
    *,
    prompts: int,
    ceiling: int,
    latency_median_s: float = 1.0,
    latency_sigma: float = 0.6,
    refusal_s: float = 0.05,
    seed: int = 0,
) -> Run:
    """The engine's dispatch loop against `provider` on a fake clock: answers take a log-normal time, refusals
    and faults `refusal_s`; a refused prompt is sent again after 0.25-0.75 s (the engine's first refused
    delay), a faulted one after 0.05-0.2 s; due retries go out before new prompts."""
    rng = random.Random(seed)
    now = [0.0]
    lim = AdaptiveLimit(ceiling=ceiling, clock=lambda: now[0])
    provider.tokens = provider.burst if provider.burst is not None else (provider.rate or 0.0)
    events: list = []  # (time, seq, kind, prompt, token)
    retries: list = []  # (due, seq, prompt)
    seq = itertools.count()
    attempts_of: dict[int, int] = {}
    fresh = iter(range(prompts))
    answered = attempts = refused = max_seen = 0
    samples: list[tuple[float, int]] = []
    next_sample = 0.0

    def admit(prompt: int, attempt: int) -> str:
        script = provider.script.get(prompt, [])
        if attempt <= len(script):
            return script[attempt - 1]
        if provider.cap is not None and provider.in_flight >= provider.cap:
            return "429"
        if provider.rate is not None:
            cap = provider.burst if provider.burst is not None else provider.rate
            provider.tokens = min(cap, provider.tokens + (now[0] - provider.refilled_at) * provider.rate)
            provider.refilled_at = now[0]
            if provider.tokens < 1.0:
                return "429"
            provider.tokens -= 1.0
        if provider.noise and rng.random() < provider.noise:
            return "429"
        return "ok"

    def dispatch() -> None:
        nonlocal attempts, max_seen
        while lim.has_room(now[0]):
            if retries and retries[0][0] <= now[0]:
                prompt = heapq.heappop(retries)[2]
            else:
                prompt = next(fresh, None)
                if prompt is None:
                    return
            attempts += 1
            attempts_of[prompt] = attempts_of.get(prompt, 0) + 1
            token = lim.on_dispatch()
            outcome = admit(prompt, attempts_of[prompt])
            if outcome == "ok":
                provider.in_flight += 1
                max_seen = max(max_seen, provider.in_flight)
                delay = latency_median_s * math.exp(latency_sigma * rng.gauss(0, 1))
            else:
                delay = refusal_s
            heapq.heappush(events, (now[0] + delay, next(seq), outcome, prompt, token))

    dispatch()
    while events or retries:
        t_event = events[0][0] if events else math.inf
        t_retry = retries[0][0] if retries and lim.has_room(now[0]) else math.inf  # a full window waits
        now[0] = min(t_event, t_retry)
        while next_sample <= now[0]:
            samples.append((next_sample, lim.window))
            next_sample += 0.1
        if t_event <= t_retry:
            _, _, outcome, prompt, token = heapq.heappop(events)
            if outcome == "ok":
                provider.in_flight -= 1
                answered += 1
                lim.on_success(token)
            elif outcome == "429":
                refused += 1
                lim.on_refused(token)
                heapq.heappush(retries, (now[0] + rng.uniform(0.25, 0.75), next(seq), prompt))
            else:  # a fault that says nothing about capacity (5xx, a reset, a malformed body)
                lim.on_done()
                heapq.heappush(retries, (now[0] + rng.uniform(0.05, 0.2), next(seq), prompt))
        dispatch()
    return Run(lim, answered, attempts, refused, now[0], max_seen, samples)


def mixed_script(prompts: int, share: float, seed: int = 1) -> dict[int, list[str]]:
    """A share of the prompts faulted on their first one to three attempts, a refusal or a fault at random
    (the engine's first fault mix: 429s, 5xx, resets, errors in 200 bodies, malformed answers); a refused
    prompt's retry is refused again as often as not, so refusals bunch where retries come due."""
    rng = random.Random(seed)
    kinds = ["429", "429", "429", "5xx", "5xx", "5xx"]
    return {
        i: [rng.choice(kinds) for _ in range(rng.randint(1, 3))]
        for i in range(prompts)
        if rng.random() < share
    }


# -- load-independent refusals
# --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name, provider, latency",
    [
        # 12% of attempts refused whatever the load. Answers as fast as the refusals (0.1 s): 3,000 dispatches
        # a second at a 300 ceiling, more than two blocks of the background in one refusal's round trip.
        # Blocks closed a block later would read as nearly empty, and every refusal cluster as a storm (7
        # cuts, 47-72 in flight).
        ("12% noise", Provider(noise=0.12), 0.1),
        # The mixed fault mix on the first attempts of 40% of the prompts (retries refused again, so refusals
        # bunch where retries come due). A background that loses each false alarm's refusals sinks until any
        # refusal looks like a storm, cuts deepen to half, and the window falls to 1 here.
        ("mixed faults", Provider(script=mixed_script(6000, 0.4)), 0.1),
    ],
)
def test_refusals_that_do_not_grow_with_the_load_leave_the_window_near_the_ceiling(name, provider, latency):
    ceiling = 300
    run = simulate(
        provider, prompts=6000, ceiling=ceiling, latency_median_s=latency, refusal_s=min(latency, 0.1)
    )
    assert run.answered == 6000
    assert run.refused_share > 0.08, run.refused_share  # the noise was there
    lim = run.limiter
    # Once ramped, the window stays near the ceiling: no collapse, at most the odd cut by beta.
    reached = next(t for t, w in run.samples if w >= ceiling)
    held = run.windows_between(reached, 0.8 * run.end)
    assert held and min(held) >= 0.8 * ceiling, (
        name,
        min(held),
        lim.stats.decreases,
        list(lim.stats.limit_trace),
    )
    assert lim.stats.decreases <= 2, (name, list(lim.stats.limit_trace))


# -- real limits are still ridden
# -----------------------------------------------------------------------------------
def test_an_in_flight_cap_still_pulls_the_window_to_it():
    cap = 200
    run = simulate(Provider(cap=cap), prompts=20_000, ceiling=2000)
    assert run.answered == 20_000
    # The window rides the cap from the middle of the run on: near it, never far above it.
    mid = run.windows_between(0.3 * run.end, 0.8 * run.end)
    assert 0.85 * cap <= min(mid) and max(mid) <= 1.15 * cap, (min(mid), max(mid))
    assert run.provider_max_in_flight == cap
    assert run.refused_share < 0.04, run.refused_share


def test_a_request_rate_bucket_still_pulls_the_window_to_it():
    rate, latency = 150.0, 1.0
    mean_latency = latency * math.exp(0.6**2 / 2)
    run = simulate(Provider(rate=rate), prompts=20_000, ceiling=2000, latency_median_s=latency)
    assert run.answered == 20_000
    # Little's law: riding the bucket takes rate × mean latency in flight; the window settles around it.
    need = rate * mean_latency
    mid = run.windows_between(0.3 * run.end, 0.8 * run.end)
    assert 0.8 * need <= sum(mid) / len(mid) <= 1.3 * need, (sum(mid) / len(mid), need)
    assert max(mid) <= 2 * need
    assert run.refused_share < 0.05, run.refused_share
    # The bucket is used: the run takes about prompts / rate.
    assert run.end <= 1.1 * 20_000 / rate + 10, run.end


def test_a_cap_behind_load_independent_noise_is_still_found():
    """12% of attempts refused whatever the load, and an in-flight cap: the cap's storms stand out of the
    noise."""
    cap = 200
    run = simulate(Provider(cap=cap, noise=0.12), prompts=20_000, ceiling=2000)
    assert run.answered == 20_000
    mid = run.windows_between(0.3 * run.end, 0.8 * run.end)
    # Ridden: near the cap on average, never far above it, and not collapsed (a background drained of the
    # noise's refusals with every storm's cut leaves 1-18 in flight here).
    assert 0.85 * cap <= sum(mid) / len(mid) and min(mid) >= 0.5 * cap and max(mid) <= 1.3 * cap, (
        min(mid),
        max(mid),
    )
    assert run.refused_share < 0.12 + 0.12, run.refused_share  # the noise, and the cap's storms beside it


# -- through the engine
# -------------------------------------------------------------------------------------------
def test_the_engine_keeps_its_window_against_a_provider_whose_refusals_do_not_depend_on_load():
    """Through the real engine: 40% of 3,000 prompts get one to three faults on their first attempts (429 with
    and without Retry-After, 503, 5xx, resets, errors in 200 bodies, malformed answers), answers take 0.1 s
    (faults too, as `FakeOpenRouter(latency=0.1)` gives them), and nothing limits the load. A window that
    reads such refusals as a limit falls to 1-3 in flight (and the run takes minutes, not seconds); this one
    stays near its 300 ceiling once it got there."""
    from .support.fake_servers import scripted_fault_prompts
    from .support.limited_provider import ProviderSpec
    from .support.virtual_clock import run_virtual

    texts = scripted_fault_prompts(3000, 0.4, seed=5, prefix="noise")
    ceiling = 300
    spec = ProviderSpec(latency_median_s=0.1, latency_sigma=0.0)
    run = run_virtual(spec, [texts], concurrency=ceiling, stream=False, retries=4, fault_s=0.1)
    run.assert_all_answered(3000)
    r = run.report
    assert r.refused_share > 0.1, r.refused_share  # the refusals were there
    reached = next((i for i, (_, w) in enumerate(r.limit_trace) if w >= ceiling), None)
    assert reached is not None, r.limit_trace
    after = [w for _, w in r.limit_trace[reached:]]
    assert min(after) >= 0.5 * ceiling, (r.limit_decreases, r.limit_trace)
