"""Adaptive concurrency: find the number of requests in flight a provider sustains, and ride it.

Why a window controlled by refusals, shaped like TCP CUBIC, and not a latency gradient or a learned rate:

- The signal is explicit. Providers refuse (429, 503 + Retry-After, OpenRouter's in-flight 402) within one network
  round trip instead of queueing, so a refusal is unambiguous and cheap to observe, while latency says little:
  service times are heavy-tailed and grow with answer length, so a Vegas/gradient limiter would read long answers
  as congestion.
- One control covers both kinds of limit. Against an in-flight cap the window is the limit itself; against a
  request-rate bucket the window sets the rate through Little's law (rate = window / mean latency), and the
  bucket's burst absorbs the random bunching of completions. A separately learned rate would need the latency
  distribution, which is exactly what is unknown until the long answers land.
- Slow start (+3 per success while the window is full: ×4 per round trip, until the first refusal, then +1: ×2)
  reaches a 2000 ceiling from 64 in under three round trips, and reaches a provider's cap in about two. In the
  first slow start a streamed request counts when the provider has accepted it (its first token arrived), not when
  its answer ends: the round trip is then a network round trip and a first token, not a whole answer (the backfill
  benchmark's 600 cap took 1.8 s to reach on answers, 0.8 s on first tokens; a thinking model's answers take
  minutes, its first tokens seconds).
  Each request counts once, at its first token or at its answer. A refusal comes back within a network round trip
  too, so when a limit is crossed only the few requests sent in that round trip are refused. (+1 per success,
  TCP's doubling, spent four round trips of answers below a 600 cap.)
- On congestion the window drops to `beta` times what the provider was accepting at that moment (the requests it had
  accepted and still held), at most once per round: refusals of requests sent before the last decrease say nothing
  new. A refusal below the level of the last one, before the window grew back to it, means the last cut did not end
  the storm (a request-rate bucket, where what the provider held says little): each further cut of one storm goes
  deeper (beta², beta³, … down to half), so coming down from a slow start's overshoot takes three or four refused
  batches, not eight (a 100 requests/s bucket: 3.8-5.5% of attempts refused, from 7.0-9.9%). Congestion means more
  refusals among the last dispatches than the provider's background refusal rate explains (the median share over
  recent blocks of dispatches, 15% until three blocks are known, with a 3σ margin and at least three refusals, over
  windows of the newest 16, 64 and 256 dispatches). Refusals of a storm that triggered a decrease are taken out of
  the background blocks, or frequent limits would raise the background and with it the size of the next storm. A
  provider that refuses 12% of requests whatever the load (an overloaded upstream behind a router) would otherwise
  collapse the window the way random loss collapses TCP on a lossy link. Crossing a real limit stands out at once:
  every slot a refusal frees is refilled and refused again, so refusals storm among the newest dispatches. Then it
  grows back on a cubic curve anchored at that level: fast while far below, nearly flat around the last level where
  refusals happened (high utilisation, few probes), and accelerating beyond it; at twice that level it probes
  exponentially again (slow start), so a limit that rises or goes away is found again within seconds.
- Growth happens only while the window is used: an answer grows it when the window was full at some moment of that
  request's flight (not only at the instant it landed: answers that land together, as with equal service times,
  each count, where checking fullness at each landing counted only the first of the bunch and left the window
  creeping up a few slots per round trip). A run held back by its budget or running out of prompts does not
  inflate a window it never tested.

A provider that declares a window for the whole key (`X-RateLimit-Remaining: 0` with `X-RateLimit-Reset`) pauses
all dispatch until the reset; every other Retry-After delays only the request that received it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

RECENT = 256  # dispatches weighed when a refusal arrives
BLOCK = 128  # dispatches per block of the background refusal rate
BLOCKS = 16
PRIOR_BACKGROUND = 0.15  # assumed background refusal share until three blocks are measured
SLOW_START_GAIN = 3.0  # window added per answer in slow start: ×(1 + gain) per round trip
# Window added per accepted request in the first slow start: ×2 per round trip of a first token. Acceptances land
# in bunches (a tick's worth at once), and what the window gains between crossing a limit and hearing its first
# refusal is refused: ×4 there overshot a 600 cap by hundreds (6.7% of a benchmark's attempts refused).
ACCEPTED_GAIN = 1.0
MIN_BETA = 0.5  # the deepest single cut, however long a storm lasts


@dataclass
class LimiterStats:
    """Counters for the progress line and the asset metadata."""

    attempts: int = 0
    refused: int = 0
    successes: int = 0
    decreases: int = 0
    global_pauses: int = 0
    max_in_flight: int = 0
    limit_trace: deque = field(default_factory=lambda: deque(maxlen=4096))  # (t, limit), ≥ 0.2 s apart

    @property
    def refused_share(self) -> float:
        return self.refused / self.attempts if self.attempts else 0.0


class AdaptiveLimit:
    """The concurrency window of one backend. Not thread-safe: used from the engine's event loop only."""

    def __init__(
        self,
        ceiling: int,
        initial: int = 64,
        beta: float = 0.9,
        cubic_c: float = 0.006,
        adaptive: bool = True,
        clock=time.monotonic,
    ):
        self.ceiling = max(1, int(ceiling))
        self.adaptive = adaptive
        self.beta = beta
        self.c = cubic_c
        self.clock = clock
        self.limit = float(self.ceiling if not adaptive else min(self.ceiling, max(1, initial)))
        self.in_flight = 0
        self.slow_start = adaptive
        self.w_max = float(self.ceiling)
        self._epoch_elapsed = 0.0  # seconds of window-limited time since the last decrease
        self._last_growth_at = clock()
        self.last_decrease_at = float("-inf")
        self._k = 0.0
        self._storm_cuts = 0  # cuts in a row that did not end a storm
        self.paused_until = 0.0
        self.stats = LimiterStats()
        self.stats.limit_trace.append((clock(), self.limit))
        self._seq = 0  # dispatches so far
        self._ring = bytearray(RECENT)  # refused marks of the last RECENT dispatches
        self._ring_start = 0  # the first dispatch after the last decrease
        self._blocks: deque[float] = deque(maxlen=BLOCKS)
        self._open_blocks: dict[int, int] = {}  # block index -> refusals (closed one block late)
        self._area = 0.0  # ∫ in_flight dt since start_accounting
        self._area_at = self._area_start = clock()
        self._full_at = float("-inf")  # the last dispatch that filled the window

    # -- accounting ----------------------------------------------------------------------------------------
    def start_accounting(self, now: float) -> None:
        self._area, self._area_at, self._area_start = 0.0, now, now

    def _account(self) -> None:
        now = self.clock()
        self._area += self.in_flight * (now - self._area_at)
        self._area_at = now

    def mean_in_flight(self, now: float) -> float:
        """Requests in flight on average (time-weighted) since `start_accounting`."""
        area = self._area + self.in_flight * (now - self._area_at)
        return area / (now - self._area_start) if now > self._area_start else 0.0

    # -- dispatch ------------------------------------------------------------------------------------------
    @property
    def window(self) -> int:
        return max(1, int(self.limit))

    def has_room(self, now: float | None = None) -> bool:
        now = self.clock() if now is None else now
        return self.in_flight < self.window and now >= self.paused_until

    def on_dispatch(self) -> tuple[float, int, int]:
        """Count one attempt in flight; returns its token (pass it back on a refusal)."""
        self._account()
        self.in_flight += 1
        if self.in_flight > self.stats.max_in_flight:
            self.stats.max_in_flight = self.in_flight
        if self.in_flight >= self.window:
            self._full_at = self._area_at  # the clock as of this dispatch (set by _account)
        self.stats.attempts += 1
        seq = self._seq
        self._seq += 1
        self._ring[seq % RECENT] = 0
        if seq % BLOCK == 0:
            block = seq // BLOCK
            self._open_blocks[block] = 0
            done = self._open_blocks.pop(block - 2, None)  # a block later: its refusals have come back
            if done is not None:
                self._blocks.append(done / BLOCK)
        return self.clock(), seq, self.in_flight - 1

    # -- outcomes ------------------------------------------------------------------------------------------
    def on_success(self, token: tuple[float, int, int] | None = None, grow: bool = True) -> None:
        """An answer; `token` (from on_dispatch) tells when its request went out. `grow=False` for a request
        that already counted when it was accepted (`on_accepted`)."""
        self._account()
        self.in_flight -= 1
        self.stats.successes += 1
        if self.adaptive and grow:
            self._grow(token[0] if token else self._area_at, self.in_flight + 1)

    @property
    def ramping(self) -> bool:
        """The first slow start: nothing refused yet, the ceiling not reached. Acceptances count only here."""
        return self.adaptive and self.slow_start and not self.stats.refused and self.limit < self.ceiling

    def on_accepted(self, token: tuple[float, int, int]) -> None:
        """A request still in flight was accepted (its first streamed token arrived): in the first slow start it
        grows the window as an answer would, a network round trip and a first token after it went out instead
        of a whole answer. The caller counts each request once (here or at its answer, not both)."""
        if self.ramping:
            self._account()
            self._grow(token[0], self.in_flight, gain=ACCEPTED_GAIN)

    def on_done(self) -> None:
        """An attempt ended without telling anything about capacity (a fault, a cancellation)."""
        self._account()
        self.in_flight -= 1

    def on_refused(self, token: tuple[float, int, int]) -> None:
        """The provider refused this attempt for capacity (429, 503 + Retry-After, in-flight 402)."""
        self._account()
        self.in_flight -= 1
        self.stats.refused += 1
        dispatched_at, seq, held_before = token
        if seq // BLOCK in self._open_blocks:
            self._open_blocks[seq // BLOCK] += 1
        if self._seq - seq <= RECENT and seq >= self._ring_start:
            self._ring[seq % RECENT] = 1
        if not self.adaptive or dispatched_at < self.last_decrease_at or not self._congested(seq):
            return  # sent before the last decrease (already answered), or within the background rate
        now = self.clock()
        # What the provider held when it said no: the requests in flight when the refused one went out, no more.
        # (Those in flight now may include later dispatches whose refusals are still on the way, and answers that
        # already landed unnoticed: counting them left the window above the cap through several decreases.)
        accepted = min(self.in_flight, held_before)
        # Refused below the level of the last refusal, before the window grew back to it: the last cut did not end
        # the storm. Against an in-flight cap the first cut does (the cap is what the provider held, and the window
        # next meets it on its way back up); against a request-rate bucket what it held says little (rate = window
        # / latency), and equal cuts took eight steps, a refused batch each, to come down from a slow start's
        # overshoot. Each further cut of one storm goes deeper.
        self._storm_cuts = self._storm_cuts + 1 if self.stats.decreases and self.limit < self.w_max else 0
        self.w_max = max(1.0, min(self.limit, accepted + 1.0))
        self.limit = max(1.0, max(MIN_BETA, self.beta ** (1 + self._storm_cuts)) * self.w_max)
        # Seconds back to w_max on the cubic, from wherever this cut left the window.
        self._k = ((1.0 - self.limit / self.w_max) / self.c) ** (1.0 / 3.0)
        self.slow_start = False
        self._epoch_elapsed = 0.0
        self._last_growth_at = now
        self.last_decrease_at = now
        self.stats.decreases += 1
        self.stats.limit_trace.append((now, self.limit))
        for seq in range(max(self._ring_start, self._seq - RECENT), self._seq):
            if self._ring[seq % RECENT] and seq // BLOCK in self._open_blocks:
                self._open_blocks[seq // BLOCK] -= 1  # a limit's storm, not the background
        self._ring = bytearray(RECENT)
        self._ring_start = self._seq

    # -- refusals beyond the background rate ---------------------------------------------------------------
    @property
    def background_refused_share(self) -> float:
        """The share of attempts refused whatever the load: the median over recent blocks."""
        if len(self._blocks) < 3:
            return PRIOR_BACKGROUND
        return sorted(self._blocks)[len(self._blocks) // 2]

    def _congested(self, seq: int) -> bool:
        """More refusals among the dispatches up to `seq` than the background rate explains, over any of a few
        window sizes: a storm among the newest dispatches shows in the small ones at once."""
        p = self.background_refused_share
        for m in (16, 64, RECENT):
            lo = max(seq - m + 1, self._ring_start, self._seq - RECENT)
            n = seq - lo + 1
            if n <= 0:
                break
            i0, i1 = lo % RECENT, seq % RECENT
            ring = self._ring
            k = ring[i0 : i1 + 1].count(1) if i0 <= i1 else ring[i0:].count(1) + ring[: i1 + 1].count(1)
            if k > n * p + 3.0 * math.sqrt(n * p * (1.0 - p)) + 2.0:
                return True
            if n < m:
                break
        return False

    def pause_all(self, until: float) -> None:
        """The provider closed a window for the whole key: nobody sends before `until` (monotonic time)."""
        if until > self.paused_until:
            self.paused_until = until
            self.stats.global_pauses += 1

    # -- growth --------------------------------------------------------------------------------------------
    def _grow(self, dispatched_at: float, held: int, gain: float = SLOW_START_GAIN) -> None:
        """`held`: the requests in flight as this one's news came, itself included."""
        now = self._area_at  # the clock as of this answer (set by _account)
        dt, self._last_growth_at = now - self._last_growth_at, now
        if self.limit >= self.ceiling:
            return
        if held < self.window and self._full_at < dispatched_at:
            return  # the window was not full during this request's flight: an untested window must not grow
        before = self.limit
        if self.stats.refused:
            gain = 1.0  # once refusals appear, probe gently
        new = self.limit + gain if self.slow_start else self.limit
        if self.stats.decreases:
            self._epoch_elapsed += min(dt, 1.0)
            new = max(new, self.w_max * (1.0 + self.c * (self._epoch_elapsed - self._k) ** 3))
            if new >= 2.0 * self.w_max:
                self.slow_start = True  # far past the last limit without a refusal: it went away, probe fast
        self.limit = min(float(self.ceiling), new)
        if int(self.limit) != int(before) and (
            now - self.stats.limit_trace[-1][0] >= 0.2 or self.limit >= self.ceiling
        ):
            self.stats.limit_trace.append((now, self.limit))

    def describe(self) -> str:
        if not self.adaptive:
            return f"limit {self.window} (fixed)"
        phase = "slow start" if self.slow_start else "steady"
        return f"limit {self.window}/{self.ceiling} ({phase})"
