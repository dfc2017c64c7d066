"""The generation engine on a virtual clock: an event loop whose clock jumps to its next timer, a simulated
provider (the `ProviderSpec` of `limited_provider.LimitedProvider` without the HTTP) and an in-memory journal,
so that the control law's timing properties are asserted with no dependence on the machine's load."""

from __future__ import annotations

import asyncio
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass

from eagle3_assets.core.generation.budget import Budget
from eagle3_assets.core.generation.engine import GenerationEngine
from eagle3_assets.core.generation.engine_settings import EngineSettings
from eagle3_assets.core.generation.lanes import Lane
from eagle3_assets.core.generation.progress_report import EngineReport
from eagle3_assets.core.generation.protocol import (
    Completion,
    CompletionRequest,
    ErrorKind,
    InferenceError,
)

from .limited_provider import ProviderSpec

# The engine's settings in `drive` and `run_virtual` alike, beside the ceiling and the retry allowance.
DRIVE_SETTINGS = dict(
    backoff_base_s=0.02, backoff_max_s=0.2, flush_interval_s=0.5, progress_interval_s=1.0, fatal_grace_s=2
)


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose clock jumps to its next timer instead of waiting for it: every delay is exactly
    what the provider model says, whatever else the machine is doing."""

    def __init__(self) -> None:
        super().__init__()
        self._now = 0.0
        select = self._selector.select

        def jump(timeout: float | None = None) -> list:
            ready = select(0)
            if not ready:
                if timeout is None:
                    raise RuntimeError("nothing scheduled and nothing to wait for: the run would hang")
                self._now += timeout
            return ready

        self._selector.select = jump

    def time(self) -> float:
        return self._now


# The fault words of `ProviderSpec.fault_mix` and of `fake_servers.FIRST_ATTEMPT_FAULTS` (`429ra=<s>` names a
# Retry-After), as the HTTP client classifies them.
FAULT_KINDS = {
    "429": ErrorKind.RATE_LIMITED,
    "body429": ErrorKind.RATE_LIMITED,
    "503": ErrorKind.OVERLOADED,
    "500": ErrorKind.SERVER,
    "502": ErrorKind.SERVER,
    "body502": ErrorKind.SERVER,
    "stream_error": ErrorKind.SERVER,
    "reset": ErrorKind.CONNECTION,
    "malformed": ErrorKind.MALFORMED,
}
SCRIPTED_FAULTS = re.compile(r"\[\[(.*)\]\]")


def fault_error(word: str) -> InferenceError:
    name, _, retry_after = word.partition("ra=")
    return InferenceError(FAULT_KINDS[name], f"sim {word}", float(retry_after) if retry_after else None)


class MemoryWriter:
    """The journal writer as the engine uses it, in memory, with when each answer landed."""

    pending = 0

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.answers: dict[str, Completion] = {}
        self.landed_at: list[float] = []
        self.failures: dict[str, str] = {}

    def add_completion(self, request_id: str, c: Completion) -> None:
        self.answers[request_id] = c
        self.landed_at.append(self.clock())

    def add_failure(self, request_id, kind, message, attempts, permanent, status) -> None:
        self.failures[request_id] = kind

    async def flush(self) -> None:
        pass

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.answers.values())


class VirtualProvider:
    """The provider `LimitedProvider` serves, as an in-process backend on the virtual clock: the same
    `ProviderSpec` limits, lengths, latencies, fault mix and streaming. A prompt may also script the faults of
    its first attempts (`[[429,500]]`, as `FakeOpenRouter` reads them)."""

    name = "openrouter"
    model = "sim/model"
    wants_prompt_ids = False
    served = None  # the engine's control law is measured here, not what is stored

    def __init__(self, spec: ProviderSpec, stream: bool, round_trip_s: float, fault_s: float):
        self.spec = spec
        self.stream = stream
        self.round_trip_s = round_trip_s  # how long a refusal for a limit takes to come back
        self.fault_s = fault_s  # the longest a fault takes (as long as the answer would, if that is shorter)
        self.tokens = spec.burst if spec.burst is not None else (spec.rate or 0.0)
        self.refilled_at = 0.0
        self.in_flight = self.max_in_flight = 0
        self.attempts = self.refused = self.answers = self.billed_tokens = 0
        self.held_before_first_answer = 0  # the most requests held before the first answer landed
        self._faults = random.Random(spec.seed + 7)
        self._tries: dict[str, int] = {}

    def set_limits(self, **limits) -> None:
        for k, v in limits.items():
            setattr(self.spec, k, v)

    def _refusal(self, now: float) -> InferenceError | None:
        spec = self.spec
        if spec.max_in_flight is not None and self.in_flight >= spec.max_in_flight:
            return InferenceError(ErrorKind.RATE_LIMITED, "in-flight cap", spec.in_flight_retry_after, 429)
        if spec.rate:
            cap = spec.burst if spec.burst is not None else spec.rate
            self.tokens = min(cap, self.tokens + (now - self.refilled_at) * spec.rate)
            self.refilled_at = now
            if self.tokens < 1.0:
                return InferenceError(ErrorKind.RATE_LIMITED, "rate limit", spec.retry_after, 429)
            self.tokens -= 1.0
        return None

    def _fault(self, text: str) -> str | None:
        attempt = self._tries[text] = self._tries.get(text, 0) + 1
        script = SCRIPTED_FAULTS.search(text)
        words = script.group(1).split(",") if script else []
        if attempt <= len(words):
            return words[attempt - 1]
        x = self._faults.random()
        for word, p in self.spec.fault_mix.items():
            if x < p:
                return word
            x -= p
        return None

    def _plan(self, text: str, max_tokens: int) -> tuple[int, float, bool]:
        """The answer's length, latency and whether it ends before max_tokens: the same draw every attempt."""
        spec = self.spec
        draw = random.Random(f"{spec.seed}:len:{text}")
        tokens = max(1, round(spec.median_tokens * math.exp(spec.sigma * draw.gauss(0, 1))))
        finished, tokens = tokens < max_tokens, min(tokens, max_tokens)
        if spec.tokens_per_s:
            return tokens, spec.base_s + tokens / spec.tokens_per_s, finished
        draw = random.Random(f"{spec.seed}:lat:{text}")
        latency = (spec.latency_median_s or 1.0) * math.exp(spec.latency_sigma * draw.gauss(0, 1))
        return tokens, latency, finished

    async def complete(self, request: CompletionRequest) -> Completion:
        self.attempts += 1
        refusal = self._refusal(asyncio.get_running_loop().time())
        if refusal is not None:
            self.refused += 1
            await asyncio.sleep(self.round_trip_s)
            raise refusal
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if not self.answers:
            self.held_before_first_answer = self.max_in_flight
        try:
            return await self._serve(request)
        finally:
            self.in_flight -= 1

    async def _serve(self, request: CompletionRequest) -> Completion:
        text = request.messages[-1]["content"]
        fault = self._fault(text)
        tokens, latency, finished = self._plan(text, request.max_tokens)
        if fault is not None and fault != "stream_error":
            await asyncio.sleep(max(self.round_trip_s, min(latency, self.fault_s)))
            raise fault_error(fault)
        chunks = max(1, min(self.spec.stream_chunks, tokens)) if self.stream else 1
        each = tokens // chunks
        for i in range(chunks):
            await asyncio.sleep(latency / chunks)
            if fault == "stream_error" and i == chunks // 2:
                raise fault_error(fault)
            if self.stream:
                request.streamed_tokens += each if i < chunks - 1 else tokens - each * i
        self.answers += 1
        self.billed_tokens += tokens
        return Completion(
            content="ok",  # a simulated answer: its length is `tokens`, its text a stand-in
            finish_reason="stop" if finished else "length",
            prompt_tokens=12,
            completion_tokens=tokens,
            model=self.model,
            provider="Sim",
            cost_usd=tokens * self.spec.cost_per_token,
        )


@dataclass
class VirtualRun:
    provider: VirtualProvider
    reports: list[EngineReport]
    writers: list[MemoryWriter]
    end: float  # virtual seconds the run took

    @property
    def report(self) -> EngineReport:
        return self.reports[0]

    def assert_all_answered(self, n: int) -> None:
        (writer,) = self.writers
        assert len(writer.answers) == n and not writer.failures, writer.failures
        assert self.report.unanswered == 0


def run_virtual(
    spec: ProviderSpec,
    datasets: list[list[str]],
    *,
    concurrency: int,
    stream: bool = True,
    retries: int = 4,
    max_tokens: int = 512,
    budget_tokens: int = 10**12,
    budget_usd: float | None = None,
    events: dict[float, Callable[[VirtualProvider], None]] | None = None,
    round_trip_s: float = 0.002,
    fault_s: float = 0.05,
    seed: int = 0,
) -> VirtualRun:
    """`drive` on the virtual clock: the engine with `drive`'s settings against `spec`, each list of texts a
    dataset of one run. `events`: what happens to the provider at a given virtual time. A refusal comes back
    in `round_trip_s` (loopback's), a fault in `fault_s` at most (`LimitedProvider`'s)."""
    loop = VirtualClockLoop()
    jitter = random.getstate()
    random.seed(seed)  # the engine's retry jitter
    try:
        provider = VirtualProvider(spec, stream, round_trip_s, fault_s)
        settings = EngineSettings(max_concurrency=concurrency, max_retries=retries, **DRIVE_SETTINGS)
        engine = GenerationEngine(provider, settings, log=lambda m: None, clock=loop.time)
        writers = [MemoryWriter(loop.time) for _ in datasets]
        lanes = [
            Lane(
                f"B{k}",
                (
                    CompletionRequest(f"B{k}-{i}", [{"role": "user", "content": t}], max_tokens)
                    for i, t in enumerate(texts)
                ),
                len(texts),
                Budget(max_tokens, budget_tokens, budget_usd, clock=loop.time),
                writer,
            )
            for k, (texts, writer) in enumerate(zip(datasets, writers, strict=True), start=1)
        ]
        for at, event in (events or {}).items():
            loop.call_at(at, event, provider)
        reports = loop.run_until_complete(engine.run(lanes))
        return VirtualRun(provider, reports, writers, loop.time())
    finally:
        random.setstate(jitter)
        loop.close()
