"""Hard token and dollar budgets that hold with heavy-tailed answer lengths and many requests in flight.

A request is dispatched only while

    spent + Σ r_i + r_new + z·sqrt(Σ v_i + v_new + (Σ e_i + e_new)²) ≤ limit

where r_i and v_i are the expected final length of in-flight request i, and its variance, *given how long it
has been running*, and e_i the standard error of that expectation (the length model is learned from the same
run). The e_i are summed before squaring: requests at the same elapsed time share one estimate, so its error
does not average out over them; the sum treats every in-flight estimate as fully correlated, the conservative
case. It matters where the model knows little, few answers beyond a long elapsed time or a small budget (a few
hundred answers), and is a few percent of the margin where it knows much; left out, small budgets under a wide
window overshoot by a few percent (3 datasets of 60k tokens each at 40 in flight: 2.6%). Conditioning on
elapsed time is what makes the rule hold: short answers land first, so the answers seen so far under-represent
long ones, and a reservation built from their mean runs low exactly when many long answers are still in flight
(by up to a quarter: 1.27×). Here the lengths are learned by latency: a Kaplan–Meier estimate over latency
bins, where finished requests are events and requests still in flight are censored at their elapsed time, so
the long answers that have not landed yet still weigh in. Each latency bin carries the mean and second moment
of the lengths that finished in it; probability mass beyond the longest latency seen so far (not yet observed)
is placed at `max_tokens`, the only bound known for it, and so is the chance that an answer is longer than
every one seen beyond its elapsed time (1/(n+1) of n exchangeable answers): a sample of heavy-tailed lengths
misses its tail most of the time, its mean and variance then run low together. When latency does not grow with
length the conditioning changes nothing, as it should. Elapsed times are read at the pace the bins were
learned at: when the provider answers faster than it did (as budgets close and load falls), each is stretched
by the speed-up (`Budget._pace`).

Streaming backends report the tokens each request has produced so far (`CompletionRequest.streamed_tokens`);
that count is a floor under its reservation. Dollars follow tokens through a linear fit cost = a + b·tokens
over the answers seen; until the first cost is known a single probe request goes out alone.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

# Log-spaced latency bins from 10 ms to 2 h (ratio ≈ 1.09 between edges).
_EDGES = np.geomspace(0.01, 7200.0, 150)
Z = 2.0  # one-sided ≈ 98% bound on the sum of what is in flight
CURVE_S = 0.1  # how often the Kaplan–Meier curve is rebuilt
SUM_S = 0.002  # how often the reservation of what is in flight is summed afresh
PACE_ALPHA = 1 / 32  # weight of each new answer in the recent pace
PACE_MIN = 16  # answers timed (learned, and in this run) before a pace counts
PACE_MAX = 4.0  # the most a faster recent pace stretches elapsed times


if TYPE_CHECKING:
    from ...config import DatasetConfig


def _bin(latency: float) -> int:
    return int(np.searchsorted(_EDGES, latency, side="right"))


class LengthHistory:
    """Answers seen so far (this run and earlier ones), binned by latency."""

    def __init__(self) -> None:
        n = len(_EDGES) + 1
        self.d = np.zeros(n)  # answers that finished in each latency bin
        self.s = np.zeros(n)  # Σ tokens
        self.q = np.zeros(n)  # Σ tokens²
        self.n = 0
        self.total_tokens = 0.0
        self.latency = LatencyFit()  # over the answers with a latency: the pace the bins were learned at

    def add(self, tokens: float, latency: float | None) -> None:
        b = _bin(latency) if latency is not None and latency > 0 else 0
        self.d[b] += 1
        self.s[b] += tokens
        self.q[b] += tokens * tokens
        self.n += 1
        self.total_tokens += tokens
        if b and latency is not None:
            self.latency.add(tokens, latency)

    def add_many(
        self, tokens: Sequence[float] | np.ndarray, latencies: Sequence[float | None] | np.ndarray
    ) -> None:
        t = np.asarray(tokens, dtype=float)
        lat = np.array([x if x is not None and x > 0 else 0.0 for x in latencies], dtype=float)
        b = np.where(lat > 0, np.searchsorted(_EDGES, lat, side="right"), 0)
        np.add.at(self.d, b, 1)
        np.add.at(self.s, b, t)
        np.add.at(self.q, b, t * t)
        self.n += len(t)
        self.total_tokens += float(t.sum())
        self.latency.add_many(t[b > 0], lat[b > 0])

    def conditional(self, censored_at: np.ndarray, cap: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(E[X | L ≥ e], Var[X | L ≥ e], the standard error of that E) for each bin e, from the Kaplan–Meier
        estimate with `censored_at` (elapsed seconds of requests still in flight) censored; unobserved mass
        sits at `cap` (no error: it is the bound itself). The error is Var/n over the n answers that finished
        beyond e."""
        c = np.zeros_like(self.d)
        if len(censored_at):
            np.add.at(c, np.searchsorted(_EDGES, censored_at, side="right"), 1)
        at_risk = np.cumsum((self.d + c)[::-1])[::-1]
        hazard = np.divide(self.d, at_risk, out=np.zeros_like(self.d), where=at_risk > 0)
        survive = np.concatenate(([1.0], np.cumprod(1.0 - hazard)))  # S before bin b; last = unobserved tail
        mass = survive[:-1] * hazard
        mean = np.divide(self.s, self.d, out=np.zeros_like(self.s), where=self.d > 0)
        second = np.divide(self.q, self.d, out=np.zeros_like(self.q), where=self.d > 0)
        tail = survive[-1]
        n1 = np.cumsum((mass * mean)[::-1])[::-1] + tail * cap
        n2 = np.cumsum((mass * second)[::-1])[::-1] + tail * cap * cap
        den = np.cumsum(mass[::-1])[::-1] + tail
        ok = den > 1e-12
        r = np.where(ok, np.divide(n1, den, out=np.full_like(n1, cap), where=ok), cap)
        m2 = np.where(ok, np.divide(n2, den, out=np.full_like(n2, cap * cap), where=ok), cap * cap)
        seen = np.cumsum(self.d[::-1])[::-1]  # answers that finished in bin e or later
        # The next answer is longer than all `seen` with probability 1/(seen + 1) (exchangeable draws): that
        # mass, whose length nothing bounds but `cap`, sits at `cap`. A sample of heavy-tailed lengths misses
        # its tail most of the time, and its mean and variance run low together; this is what holds the margin
        # up.
        unseen = 1.0 / (seen + 1.0)
        r = (1.0 - unseen) * r + unseen * cap
        m2 = (1.0 - unseen) * m2 + unseen * cap * cap
        var = np.maximum(m2 - r * r, 0.0)
        se = np.sqrt(np.divide(var, seen, out=np.zeros_like(var), where=seen > 0))
        return np.minimum(r, cap), var, se


class CostFit:
    """cost ≈ a + b·tokens, by least squares over answers that reported a cost."""

    def __init__(self) -> None:
        self.n = 0
        self.sx = self.sy = self.sxx = self.sxy = self.syy = 0.0

    def add(self, tokens: float, cost: float) -> None:
        self.n += 1
        self.sx += tokens
        self.sy += cost
        self.sxx += tokens * tokens
        self.sxy += tokens * cost
        self.syy += cost * cost

    def add_many(self, tokens: Sequence[float] | np.ndarray, costs: Sequence[float] | np.ndarray) -> None:
        x, y = np.asarray(tokens, dtype=float), np.asarray(costs, dtype=float)
        self.n += len(x)
        self.sx += float(x.sum())
        self.sy += float(y.sum())
        self.sxx += float((x * x).sum())
        self.sxy += float((x * y).sum())
        self.syy += float((y * y).sum())

    def _moments(self) -> tuple[float, float, float | None]:
        """(mean x, mean y, the least-squares slope, or None where x barely varies)."""
        n = self.n
        mx, my = self.sx / n, self.sy / n
        vx = self.sxx / n - mx * mx
        if vx <= 1e-9 * max(1.0, mx * mx):
            return mx, my, None
        return mx, my, (self.sxy / n - mx * my) / vx

    def coefficients(self) -> tuple[float, float, float]:
        """(a, b, residual variance)."""
        n = self.n
        mx, my, slope = self._moments()
        if slope is None:
            b = my / mx if mx > 0 else 0.0
            a = 0.0 if mx > 0 else my
        else:
            b = max(0.0, slope)
            a = max(0.0, my - b * mx)
        resid = (
            self.syy / n - 2 * a * my - 2 * b * self.sxy / n + a * a + 2 * a * b * mx + b * b * self.sxx / n
        )
        return a, b, max(0.0, resid)


class LatencyFit(CostFit):
    """latency ≈ a + b·tokens (the time to a first token, then seconds per token), by least squares."""

    def predict(self, tokens: float) -> float | None:
        """The latency expected for an answer of `tokens`; None while latency does not visibly grow with
        length (then elapsed time says little about length, and there is no pace to read it at)."""
        if self.n < PACE_MIN:
            return None
        mx, my, b = self._moments()
        if b is None or b <= 0:
            return None
        latency = my + b * (tokens - mx)
        return latency if latency > 0 else None


class Ticket:
    """One attempt in flight: its slot in the budget's arrays, and the request (for streamed-token counts)."""

    __slots__ = ("request", "slot", "start")

    def __init__(self, slot: int, start: float, request: Any):
        self.slot = slot
        self.start = start
        self.request = request


@dataclass
class PriorUsage:
    """What earlier runs (every backend, imports, and requests lost in flight) already spent and taught."""

    n_responses: int
    completion_tokens: int
    cost_usd: float
    history: LengthHistory
    costs: CostFit
    lost_requests: int = 0
    lost_tokens: float = 0.0


class Budget:
    """Completion tokens (reasoning included) and optional dollars for one dataset, all backends together.

    In-flight start times live in numpy arrays, so the reservation is summed afresh every few milliseconds at
    a cost of microseconds: a reservation even 0.1 s stale runs 18% low when answers take 0.2 s.
    """

    def __init__(
        self,
        max_tokens_per_request: int,
        token_limit: int,
        usd_limit: float | None = None,
        tokens_used: int = 0,
        usd_used: float = 0.0,
        history: LengthHistory | None = None,
        costs: CostFit | None = None,
        clock=time.monotonic,
    ):
        self.max_tokens = float(max_tokens_per_request)
        self.token_limit = token_limit
        self.usd_limit = usd_limit
        self.tokens_used = int(tokens_used)
        self.usd_used = float(usd_used)
        self.history = history or LengthHistory()
        self.cost = costs or CostFit()
        self.usd_unreported = 0  # answers without a cost (SGLang, local, most vLLM servers)
        self.clock = clock
        self._tickets: dict[int, Ticket] = {}
        self._starts = np.zeros(64)
        self._active = np.zeros(64, dtype=bool)
        self._floor = np.zeros(64)  # tokens streamed so far (refreshed with the curve)
        self._r = np.zeros(64)  # reservation per slot, as of the last sum
        self._v = np.zeros(64)
        self._e = np.zeros(64)  # the standard error of the slot's reservation
        self._free: list[int] = list(range(63, -1, -1))
        self._reserved = 0.0
        self._variance = 0.0
        self._error = 0.0  # Σ e_i: added before squaring (one shared estimate)
        n = len(_EDGES) + 1
        self._mean, self._var, self._se = np.full(n, self.max_tokens), np.zeros(n), np.zeros(n)
        self._curve_at = self._summed_at = float("-inf")
        self._curve_n = -1
        self._recent_s = self._recent_expected_s = 0.0  # this run's answers, exponentially weighted
        self._recent_n = 0
        self.pace = 1.0  # elapsed times are read at the pace the length model was learned at (see _pace)

    @classmethod
    def for_dataset(cls, dataset: DatasetConfig, prior: PriorUsage) -> Budget:
        """A dataset's budget with everything spent before counted: the one rule for dispatch and top-ups."""
        return cls(
            dataset.max_tokens,
            dataset.budget_tokens,
            dataset.budget_usd,
            prior.completion_tokens,
            prior.cost_usd,
            history=prior.history,
            costs=prior.costs,
        )

    # -- estimates -------------------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        return len(self._tickets)

    @property
    def _r_new(self) -> float:
        return float(self._mean[0])

    @property
    def _v_new(self) -> float:
        return float(self._var[0])

    @property
    def _e_new(self) -> float:
        return float(self._se[0])

    def _refresh(self, now: float) -> None:
        # The curve every CURVE_S (it drifts slowly), and at every answer while few are known.
        if now - self._curve_at >= CURVE_S or (self.history.n != self._curve_n and self.history.n <= 64):
            self._curve_at, self._curve_n = now, self.history.n
            self.pace = self._pace()
            if self.history.n:
                self._mean, self._var, self._se = self.history.conditional(
                    self._elapsed(now), self.max_tokens
                )
            for t in self._tickets.values():
                self._floor[t.slot] = getattr(t.request, "streamed_tokens", 0) or 0
        if now - self._summed_at < SUM_S:
            return
        self._summed_at = now
        active = self._active
        # Latencies strictly above the elapsed time: the bin holding it also has answers that finished just
        # before it, and counting them would bias the reservation low by ~5%.
        bins = np.minimum(np.searchsorted(_EDGES, self._elapsed(now), side="right") + 1, len(self._mean) - 1)
        r = np.maximum(self._mean[bins], self._floor[active])
        v, e = self._var[bins], self._se[bins]
        self._r[active], self._v[active], self._e[active] = r, v, e
        self._reserved, self._variance, self._error = float(r.sum()), float(v.sum()), float(e.sum())

    def _elapsed(self, now: float) -> np.ndarray:
        """How long each request in flight has run, read at the pace the length model learned (see _pace)."""
        return (now - self._starts[self._active]) * self.pace

    def _pace(self) -> float:
        """How much faster the recent answers came than the answers the length model learned from (1 to
        PACE_MAX).

        The model maps elapsed time to length at the pace it was learned at. When the provider speeds up (a
        local server's batch shrinking as budgets close, a loaded provider or client easing), a request in
        flight for a given time is longer than the model says, and the reservation runs low exactly at a
        budget's end: a client beside busy processes that answers twice as fast at the end of a run as in its
        middle otherwise ends one budget in ten over 1.02x (up to 1.044x). Elapsed times are read at the
        learned pace, stretched by the speed-up: the latencies the recent answers were expected to take, for
        their lengths, by a line fitted over all answers learned (a + b·tokens: a mere share of seconds per
        token would call the long answers that land late a speed-up), against the latencies they took. A
        slower recent pace does not shrink them."""
        if self._recent_n < PACE_MIN or self._recent_s <= 0:
            return 1.0
        return min(max(self._recent_expected_s / self._recent_s, 1.0), PACE_MAX)

    def spent_share(self) -> float:
        """The larger of the shares of the token and the dollar limit already spent."""
        share = self.tokens_used / self.token_limit if self.token_limit else 1.0
        if self.usd_limit:
            share = max(share, self.usd_used / self.usd_limit)
        return share

    def committed_share(self) -> float:
        """The share of the limit spent, or expected from what is in flight (tokens; dollars as spent)."""
        if not self.token_limit:
            return 1.0
        self._refresh(self.clock())
        return max((self.tokens_used + self._reserved) / self.token_limit, self.spent_share())

    def expected_tokens(self) -> float:
        """The expected length of a new answer (what a request lost in flight is charged)."""
        self._refresh(self.clock())
        return self._r_new

    def _fits(self, used: float, reserved: float, variance: float, limit: float) -> bool:
        return used + reserved + Z * math.sqrt(max(variance, 0.0)) <= limit

    def can_dispatch(self) -> bool:
        self._refresh(self.clock())
        reserved = self._reserved + self._r_new
        error = self._error + self._e_new
        variance = self._variance + self._v_new + error * error
        if not self._fits(self.tokens_used, reserved, variance, self.token_limit):
            return False
        if self.usd_limit is None or (self.cost.n == 0 and self.usd_unreported > 0):
            return True  # no dollar limit, or a backend that reports no cost: only the token budget applies
        if self.cost.n == 0:
            return self.in_flight == 0  # probe with one request until a cost is known
        a, b, resid = self.cost.coefficients()
        n = self.in_flight + 1
        usd_reserved = n * a + b * reserved
        usd_variance = b * b * variance + n * resid
        return self._fits(self.usd_used, usd_reserved, usd_variance, self.usd_limit)

    # -- bookkeeping ---------------------------------------------------------------------------------------
    def open(self, request: Any = None) -> Ticket:
        """Reserve for one attempt about to be sent."""
        if not self._free:
            self._grow()
        slot = self._free.pop()
        t = Ticket(slot, self.clock(), request)
        self._tickets[slot] = t
        self._starts[slot], self._active[slot], self._floor[slot] = t.start, True, 0.0
        self._r[slot], self._v[slot], self._e[slot] = self._r_new, self._v_new, self._e_new
        self._reserved += self._r_new
        self._variance += self._v_new
        self._error += self._e_new
        return t

    def _grow(self) -> None:
        n = len(self._starts)
        for name in ("_starts", "_floor", "_r", "_v", "_e"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(n)]))
        self._active = np.concatenate([self._active, np.zeros(n, dtype=bool)])
        self._free.extend(range(2 * n - 1, n - 1, -1))

    def settle(
        self,
        ticket: Ticket,
        completion_tokens: int | None,
        cost_usd: float | None,
        latency_s: float | None = None,
    ) -> None:
        """The attempt ended; `completion_tokens` None means nothing was bought (an error)."""
        slot = ticket.slot
        if self._tickets.pop(slot, None) is None:
            return
        self._active[slot] = False
        self._free.append(slot)
        self._reserved -= self._r[slot]
        self._variance -= self._v[slot]
        self._error -= self._e[slot]
        if completion_tokens is not None:
            self.tokens_used += completion_tokens
            latency = latency_s if latency_s else self.clock() - ticket.start
            expected = self.history.latency.predict(completion_tokens) if latency > 0 else None
            if expected is not None:
                self._recent_s += PACE_ALPHA * (latency - self._recent_s)
                self._recent_expected_s += PACE_ALPHA * (expected - self._recent_expected_s)
                self._recent_n += 1
            self.history.add(completion_tokens, latency)
            if cost_usd is not None:
                self.usd_used += cost_usd
                self.cost.add(completion_tokens, cost_usd)
            else:
                self.usd_unreported += 1
        if not self._tickets:
            self._reserved = self._variance = self._error = 0.0  # no drift from float sums

    def charge(self, tokens: float, usd: float = 0.0) -> None:
        """Spend that produced no answer to learn from (requests lost in flight at a crash)."""
        self.tokens_used += round(tokens)
        self.usd_used += usd

    def estimated_usd(self, tokens: float) -> float:
        if self.cost.n == 0:
            return 0.0
        a, b, _ = self.cost.coefficients()
        return a + b * tokens

    def describe(self) -> str:
        text = f"{self.tokens_used:,}/{self.token_limit:,} tokens"
        if self.usd_limit is not None:
            text += f", ${self.usd_used:,.2f}/${self.usd_limit:,.2f}"
        return text
