"""What a run reports: each lane's own figures (`EngineReport`), and the key-wide counters behind the progress
line (`RunProgress`).

The window and what was in flight belong to the key, not to a dataset: every lane's report carries the same
key-wide figures, filled once at the end of the run. The progress line reads rates over its recent lines (not
the whole run), so a provider that slows down or starts refusing shows at once.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .limiter import AdaptiveLimit
    from .protocol import Completion


class _DescribedBudget(Protocol):
    def describe(self) -> str: ...


class ReportedLane(Protocol):
    """What the key-wide counters read of a lane (`lanes.Lane` is one): named here so that this module needs
    nothing of the lanes, which carry its reports (no circle)."""

    @property
    def key(self) -> str: ...

    @property
    def report(self) -> EngineReport: ...

    @property
    def budget(self) -> _DescribedBudget: ...


@dataclass
class EngineReport:
    total: int
    sent: int = 0  # prompts sent at least once
    succeeded: int = 0
    failed: int = 0
    permanent_failures: int = 0
    attempts: int = 0
    refused: int = 0  # attempts the provider refused for capacity
    prompt_tokens: int = 0
    completion_tokens: int = 0  # charged: the larger of the provider's usage and our own count, per answer
    reported_completion_tokens: int = 0  # what the providers' usage said
    counted_completion_tokens: int = 0  # what this platform counted of what arrived
    cut_at_max_tokens: int = 0  # answers longer than max_tokens, kept up to the limit
    refused_answers: int = 0  # answers served by another model than the target: set aside, asked again
    cost_usd: float = 0.0
    usage_estimated: int = 0
    errors: Counter = field(default_factory=Counter)
    failure_kinds: Counter = field(default_factory=Counter)
    providers: Counter = field(default_factory=Counter)
    finish_reasons: Counter = field(default_factory=Counter)
    latencies: list[float] = field(default_factory=list)
    elapsed_s: float = 0.0
    stop_reason: str = "done"  # done | budget | fatal | terminated
    fatal_message: str | None = None
    unanswered: int = 0  # prompts taken from the queue that ended the run with no answer and no failure row
    limit_final: int = 0
    limit_min: int = 0
    limit_max: int = 0
    limit_decreases: int = 0
    global_pauses: int = 0
    max_in_flight: int = 0
    mean_in_flight: float = 0.0  # time-weighted over the run, all lanes together (the key's)
    first_dispatch_s: float | None = None  # seconds from the engine's start to its first request
    first_dispatch_wall: float | None = None  # when it was sent (seconds since the epoch)
    limit_trace: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, window)

    def latency_percentiles(self) -> dict[str, float]:
        if not self.latencies:
            return {}
        xs = sorted(self.latencies)
        pick = lambda q: xs[min(len(xs) - 1, int(q * (len(xs) - 1) + 0.5))]  # noqa: E731
        return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99), "max": xs[-1]}

    @property
    def refused_share(self) -> float:
        return self.refused / self.attempts if self.attempts else 0.0

    @property
    def goodput_rps(self) -> float:
        return self.succeeded / self.elapsed_s if self.elapsed_s else 0.0

    def record_answer(self, c: Completion, backend_name: str) -> None:
        self.succeeded += 1
        self.prompt_tokens += c.prompt_tokens
        self.completion_tokens += c.charged_tokens
        self.reported_completion_tokens += c.completion_tokens
        self.counted_completion_tokens += (
            c.counted_tokens if c.counted_tokens is not None else c.completion_tokens
        )
        self.cut_at_max_tokens += c.cut_at_max_tokens
        self.cost_usd += c.cost_usd or 0.0
        self.usage_estimated += c.usage_estimated
        self.providers[c.provider or backend_name] += 1
        self.finish_reasons[c.finish_reason] += 1
        self.latencies.append(c.latency_s)

    def record_failure(self, kind: str, permanent: bool) -> None:
        self.failed += 1
        self.failure_kinds[kind] += 1
        if permanent:
            self.permanent_failures += 1


@dataclass(frozen=True, slots=True)
class RateSample:
    """The key-wide counters as one progress line saw them."""

    at: float
    succeeded: int
    attempts: int
    refused: int


class RunProgress:
    """Counters of the whole key (all lanes together): the progress line's rates, the reports' shared
    figures."""

    def __init__(self) -> None:
        self.succeeded = self.attempts = self.refused = 0
        self.first_dispatch_at: float | None = None
        self.first_dispatch_wall: float | None = None
        self._recent: deque[RateSample] = deque(maxlen=64)

    def on_dispatch(self, at: float) -> None:
        self.attempts += 1
        if self.first_dispatch_at is None:
            self.first_dispatch_at, self.first_dispatch_wall = at, time.time()

    def fill_reports(
        self, lanes: Sequence[ReportedLane], limiter: AdaptiveLimit, start: float, now: float, elapsed: float
    ) -> None:
        """The key's window and in-flight figures, the same in every lane's report (the lanes share
        them)."""
        stats = limiter.stats
        trace = [int(w) for _, w in stats.limit_trace] or [limiter.window]
        mean_in_flight = limiter.mean_in_flight(now)
        first = None if self.first_dispatch_at is None else self.first_dispatch_at - start
        for lane in lanes:
            r = lane.report
            r.elapsed_s = elapsed
            r.limit_final, r.limit_min, r.limit_max = limiter.window, min(trace), max(trace)
            r.limit_decreases, r.global_pauses = stats.decreases, stats.global_pauses
            r.max_in_flight = stats.max_in_flight
            r.mean_in_flight = mean_in_flight
            r.first_dispatch_s = first
            r.first_dispatch_wall = self.first_dispatch_wall
            r.limit_trace = [(t, int(w)) for t, w in stats.limit_trace]

    def _rates(self, start: float, now: float, final: bool) -> tuple[float, float]:
        """Answers per second and the refused share: since the oldest recent line, or over the whole run."""
        if final:
            return self.succeeded / max(now - start, 1e-9), self.refused / max(self.attempts, 1)
        self._recent.append(RateSample(now, self.succeeded, self.attempts, self.refused))
        since = self._recent[0] if len(self._recent) > 1 else RateSample(start, 0, 0, 0)
        goodput = (self.succeeded - since.succeeded) / max(now - since.at, 1e-9)
        return goodput, (self.refused - since.refused) / max(self.attempts - since.attempts, 1)

    def line(
        self, lanes: Sequence[ReportedLane], limiter: AdaptiveLimit, start: float, now: float, final: bool
    ) -> str:
        """One progress line (or the run's last, `final`) over every lane."""
        elapsed = max(now - start, 1e-9)
        reports = [lane.report for lane in lanes]
        total = sum(r.total for r in reports)
        ok = sum(r.succeeded for r in reports)
        failed = sum(r.failed for r in reports)
        tokens = sum(r.completion_tokens for r in reports)
        cost = sum(r.cost_usd for r in reports)
        errors: Counter = sum((r.errors for r in reports), Counter())
        goodput, refused = self._rates(start, now, final)
        eta = "-"
        if goodput > 0 and not final:
            eta_s = (total - ok - failed) / goodput
            eta = f"{eta_s / 60:.1f} min" if eta_s < 7200 else f"{eta_s / 3600:.1f} h"
        budgets = (
            lanes[0].budget.describe()
            if len(lanes) == 1
            else "; ".join(f"{lane.key} {lane.budget.describe()}" for lane in lanes)
        )
        pauses = limiter.stats.global_pauses
        head = "finished" if final else "progress"
        return (
            f"{head}: {ok + failed:,}/{total:,} done ({ok:,} ok, {failed:,} failed), "
            f"goodput {goodput:.1f} answers/s, {tokens / elapsed:,.0f} tok/s, ${cost:,.4f}, "
            f"in flight {limiter.in_flight}, {limiter.describe()}, refused {refused:.1%}, "
            f"budget {budgets}, errors: {', '.join(f'{k} {v}' for k, v in errors.most_common()) or 'none'}"
            + ("" if final else f", ETA {eta}")
            + (f", key-wide pauses {pauses}" if pauses else "")
        )
