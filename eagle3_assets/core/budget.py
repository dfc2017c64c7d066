"""Hard token and dollar budgets that account for requests still in flight.

A request is dispatched only if what is spent, plus a statistical reservation for everything in flight, plus the
new request's own reservation stays within the budget. The reservation starts at `max_tokens` (nothing is known)
and narrows to mean + 3σ/√n of the completions seen so far, which keeps the total overshoot of n parallel requests
within a few standard errors instead of n × max_tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

WARMUP_SAMPLES = 32


@dataclass
class RunningStats:
    n: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        d = x - self.mean
        self.mean += d / self.n
        self.m2 += d * (x - self.mean)

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / (self.n - 1)) if self.n > 1 else 0.0


@dataclass
class Budget:
    """Completion tokens (reasoning included) and optional dollars for one dataset, all backends together."""

    max_tokens_per_request: int
    token_limit: int
    usd_limit: float | None = None
    tokens_used: int = 0
    usd_used: float = 0.0
    in_flight: int = 0
    tokens: RunningStats = field(default_factory=RunningStats)
    usd: RunningStats = field(default_factory=RunningStats)
    usd_unreported: int = 0  # answers that came back without a cost (SGLang, local, most vLLM servers)

    def _reserve(self, stats: RunningStats, n: int, cap_per_request: float) -> float:
        """Tokens (or dollars) to hold back for n requests in flight."""
        if n <= 0:
            return 0.0
        if stats.n < WARMUP_SAMPLES:
            return n * cap_per_request
        bound = n * stats.mean + 3.0 * stats.std * math.sqrt(n)
        return min(n * cap_per_request, bound)

    def _usd_cap(self) -> float:
        # Before any cost is seen, a request may cost anything: hold the dollar budget back until samples arrive.
        if self.usd.n == 0:
            return self.usd_limit or 0.0
        per_token = self.usd.mean / max(self.tokens.mean, 1.0)
        return max(self.usd.mean, per_token * self.max_tokens_per_request)

    def can_dispatch(self) -> bool:
        n = self.in_flight + 1
        tokens_ok = (
            self.tokens_used + self._reserve(self.tokens, n, self.max_tokens_per_request) <= self.token_limit
        )
        if not tokens_ok:
            return False
        if self.usd_limit is None or (self.usd.n == 0 and self.usd_unreported > 0):
            return True  # no dollar limit, or a backend that reports no cost: only the token budget applies
        if self.usd.n == 0 and self.in_flight > 0:
            return False  # probe with one request until its cost is known
        return self.usd_used + self._reserve(self.usd, n, self._usd_cap()) <= self.usd_limit

    def dispatch(self) -> None:
        self.in_flight += 1

    def settle(self, completion_tokens: int | None, cost_usd: float | None) -> None:
        self.in_flight -= 1
        if completion_tokens is not None:
            self.tokens_used += completion_tokens
            self.tokens.add(completion_tokens)
        if cost_usd is not None:
            self.usd_used += cost_usd
            self.usd.add(cost_usd)
        elif completion_tokens is not None:
            self.usd_unreported += 1

    def describe(self) -> str:
        text = f"{self.tokens_used:,}/{self.token_limit:,} tokens"
        if self.usd_limit is not None:
            text += f", ${self.usd_used:,.2f}/${self.usd_limit:,.2f}"
        return text
