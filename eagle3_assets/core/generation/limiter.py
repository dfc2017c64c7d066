"""Adaptive concurrency: find the number of requests in flight a provider sustains, and ride it.

Why a window controlled by refusals, shaped like TCP CUBIC, and not a latency gradient or a learned rate:

- The signal is explicit. Providers refuse (429, 503 + Retry-After, OpenRouter's in-flight 402) within one
  network round trip instead of queueing, so a refusal is unambiguous and cheap to observe, while latency says
  little: service times are heavy-tailed and grow with answer length, so a Vegas/gradient limiter would read
  long answers as congestion.
- One control covers both kinds of limit. Against an in-flight cap the window is the limit itself; against a
  request-rate bucket the window sets the rate through Little's law (rate = window / mean latency), and the
  bucket's burst absorbs the random bunching of completions. A separately learned rate would need the latency
  distribution, which is exactly what is unknown until the long answers land.
- Slow start (+3 per success while the window is full: ×4 per round trip, until the first cut, then +1: ×2)
  reaches a 2000 ceiling from 64 in under three round trips, and reaches a provider's cap in about two; TCP's
  +1 (×2) spends twice as many round trips of answers below the cap. In the first slow start a streamed
  request counts when the provider has accepted it (its first token arrived, `ramp.FirstTokenRamp`), not when
  its answer ends: the round trip is then a network round trip and a first token, not a whole answer (a
  thinking model's answers take minutes, its first tokens seconds). Each request counts once, at its first
  token or at its answer. A refusal comes back within a network round trip too, so when a limit is crossed
  only the few requests sent in that round trip are refused.
- On congestion the window drops to `beta` times what the provider was accepting at that moment (the requests
  it had accepted and still held), at most once per round: refusals of requests sent before the last decrease
  say nothing new. A refusal below the level of the last one, before the window grew back to it, means the
  last cut did not end the storm (a request-rate bucket, where what the provider held says little): each
  further cut of one storm goes deeper (beta², beta³, … down to half), so coming down from a slow start's
  overshoot takes three or four refused batches where equal cuts take eight, and a request-rate bucket refuses
  about half as many attempts. Then it grows back on a cubic curve anchored at that level: fast while far
  below, nearly flat around the last level where refusals happened (high utilisation, few probes), and
  accelerating beyond it; at twice that level it probes exponentially again (slow start), so a limit that
  rises or goes away is found again within seconds.
- Congestion means more refusals among the newest dispatches than the provider's background refusal rate
  explains: more than 1.5 times the background share, with a 3σ margin and at least three refusals, over
  windows of the newest 16, 64 and 256 dispatches. Crossing a real limit stands out at once: every slot a
  refusal frees is refilled and refused again, so refusals storm among the newest dispatches.
- Noise is not a limit. A provider that refuses a share of requests whatever the load (an upstream's own
  capacity behind a router, often beside 5xx and resets) must read as background, or the window collapses the
  way random loss collapses TCP on a lossy link. The background is the median refused share over recent blocks
  of 128 dispatches (15% until three are known), and three things keep it honest: a block counts only once its
  refusals have come back, twice the refusals' round trip after its last dispatch (a fixed number of
  dispatches later, fast answers would read as an empty background); blocks sent at the level a storm was cut
  from are left out whole (taking only each storm's refusals out of them would drain the background with every
  false alarm, until any refusal looked like a storm); and the margin is relative, as retries of refused
  prompts, refused again, raise the share for a while with no limit behind it. Slow start keeps its ×4 until
  the first cut, not the first refusal, which a noisy provider sends at once.
- Growth happens only while the window is used: an answer grows it when the window was full at some moment of
  that request's flight (not only at the instant it landed: answers that land together, as with equal service
  times, each count, where checking fullness at each landing would count only the first of the bunch and leave
  the window creeping up a few slots per round trip). A run held back by its budget or running out of prompts
  does not inflate a window it never tested.

A provider that declares a window for the whole key (`X-RateLimit-Remaining: 0` with `X-RateLimit-Reset`)
pauses all dispatch until the reset; every other Retry-After delays only the request that received it.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

RECENT = 256  # dispatches weighed when a refusal arrives (the widest of the windows tested)
RING = 4096  # dispatches whose refusals are remembered: more than go out in one refusal's round trip
BLOCK = 128  # dispatches per block of the background refusal rate
BLOCKS = 16  # the newest settled blocks whose median is the background
KEPT_BLOCKS = 64  # unsettled blocks kept at most (their refusals may still be on the way)
PRIOR_BACKGROUND = 0.15  # assumed background refusal share until three blocks are measured
SLOW_START_GAIN = 3.0  # window added per answer in slow start: ×(1 + gain) per round trip
# Window added per accepted request in the first slow start: ×2 per round trip of a first token. Acceptances
# land in bunches (a tick's worth at once), and what the window gains between crossing a limit and hearing its
# first refusal is refused: ×4 there overshoots a 600 cap by hundreds of requests.
ACCEPTED_GAIN = 1.0
MIN_BETA = 0.5  # the deepest single cut, however long a storm lasts


@dataclass(frozen=True, slots=True)
class DispatchToken:
    """One attempt as the limiter saw it go out; handed back with its outcome."""

    sent_at: float  # the limiter's clock at dispatch
    seq: int  # its dispatch number (where its refusal is marked)
    held_before: int  # requests in flight before it: what the provider held when it went out


@dataclass(slots=True)
class _Block:
    """BLOCK consecutive dispatches, weighed for the background refusal rate once their refusals are back."""

    refused: int = 0
    last_sent_at: float = 0.0  # the clock at its latest dispatch
    left_out: bool = False  # sent at the level a storm was cut from: a limit's refusals, not the background's


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
        clock: Callable[[], float] = time.monotonic,
    ):
        self.ceiling = max(1, int(ceiling))
        self.beta = beta
        self.c = cubic_c
        self.clock = clock
        self.limit = float(min(self.ceiling, max(1, initial)))
        self.in_flight = 0
        self.slow_start = True
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
        self._ring = bytearray(RING)  # refused marks of the last RING dispatches
        self._ring_start = 0  # the first dispatch after the last decrease
        # Block index -> its block, until it settles into `_background` (its refused share) or is dropped
        # (left out: sent at the level a storm was cut from).
        self._blocks: dict[int, _Block] = {}
        self._background: deque[float] = deque(maxlen=BLOCKS)
        self._refusal_rtts: deque[float] = deque(maxlen=64)  # how long the latest refusals took to come back
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

    def on_dispatch(self) -> DispatchToken:
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
        self._ring[seq % RING] = 0
        block = self._blocks.get(seq // BLOCK)
        if block is None:
            block = self._blocks[seq // BLOCK] = _Block()
        block.last_sent_at = self._area_at
        return DispatchToken(self._area_at, seq, self.in_flight - 1)

    # -- outcomes ------------------------------------------------------------------------------------------
    def on_success(self, token: DispatchToken | None = None, grow: bool = True) -> None:
        """An answer; `token` (from on_dispatch) tells when its request went out. `grow=False` for a request
        that already counted when it was accepted (`on_accepted`)."""
        self._account()
        self.in_flight -= 1
        self.stats.successes += 1
        if grow:
            self._grow(token.sent_at if token else self._area_at, self.in_flight + 1)

    @property
    def ramping(self) -> bool:
        """The first slow start: nothing refused yet, the ceiling not reached. Acceptances count only here."""
        return self.slow_start and not self.stats.refused and self.limit < self.ceiling

    def on_accepted(self, token: DispatchToken) -> None:
        """A request still in flight was accepted (its first streamed token arrived): in the first slow start
        it grows the window as an answer would, a network round trip and a first token after it went out
        instead of a whole answer. The caller counts each request once (here or at its answer, not both)."""
        if self.ramping:
            self._account()
            self._grow(token.sent_at, self.in_flight, gain=ACCEPTED_GAIN)

    def on_done(self) -> None:
        """An attempt ended without telling anything about capacity (a fault, a cancellation)."""
        self._account()
        self.in_flight -= 1

    def on_refused(self, token: DispatchToken) -> None:
        """The provider refused this attempt for capacity (429, 503 + Retry-After, in-flight 402)."""
        self._account()
        self.in_flight -= 1
        self.stats.refused += 1
        seq = token.seq
        now = self._area_at
        self._refusal_rtts.append(now - token.sent_at)
        block = self._blocks.get(seq // BLOCK)
        if block is not None:
            block.refused += 1
        if self._seq - seq <= RING and seq >= self._ring_start:
            self._ring[seq % RING] = 1
        if token.sent_at < self.last_decrease_at:
            return  # sent before the last decrease: already answered
        p = self.background_refused_share
        storm = self._storm(seq, p)
        if storm is None:
            return  # within the background rate
        # What the provider held when it said no: the requests in flight when the refused one went out, no
        # more. (Those in flight at this point may include later dispatches whose refusals are still on the
        # way, and answers that already landed unnoticed: counting them would leave the window above the cap
        # through several decreases.)
        accepted = min(self.in_flight, token.held_before)
        # Refused below the level of the last refusal, before the window grew back to it: the last cut did not
        # end the storm. Against an in-flight cap the first cut does (the cap is what the provider held, and
        # the window next meets it on its way back up); against a request-rate bucket what it held says little
        # (rate = window / latency), and equal cuts would take eight steps, a refused batch each, to come down
        # from a slow start's overshoot. Each further cut of one storm goes deeper.
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
        # The blocks of the storm, from its first dispatch on, were sent at the level it was cut from: a
        # limit's refusals, not the background's (those that come back after the cut included). Left out
        # whole, not cleaned of the storm's refusals: taking every refusal out would drain the background of a
        # noisy provider with each false alarm, until any refusal looked like a storm.
        for index, block in self._blocks.items():
            if index >= storm // BLOCK:
                block.left_out = True
        self._ring = bytearray(RING)
        self._ring_start = self._seq

    # -- refusals beyond the background rate ---------------------------------------------------------------
    @property
    def background_refused_share(self) -> float:
        """The share of attempts refused whatever the load: the median over the newest settled blocks, less
        those sent at the level a storm was cut from."""
        self._settle()
        if len(self._background) < 3:
            return PRIOR_BACKGROUND
        return sorted(self._background)[len(self._background) // 2]

    def _settle(self) -> None:
        """A block settles once its refusals have come back (its last dispatch older than twice the round trip
        of recent refusals, their 90th percentile) and a storm among the newest RECENT dispatches can no
        longer include it. Closed a fixed number of dispatches later, a block would read as empty whenever
        more than that go out in a refusal's round trip (3,000 a second against refusals of 0.1 s)."""
        rtts = sorted(self._refusal_rtts)
        back = self.clock() - (2.0 * rtts[(len(rtts) - 1) * 9 // 10] if rtts else 0.0)
        while self._blocks:
            index = next(iter(self._blocks))
            block = self._blocks[index]
            recent = block.last_sent_at > back and len(self._blocks) <= KEPT_BLOCKS
            if (index + 1) * BLOCK > self._seq - RECENT or recent:
                return
            del self._blocks[index]
            if not block.left_out:
                self._background.append(block.refused / BLOCK)

    def _ring_count(self, lo: int, hi: int) -> int:
        """Refusals marked among dispatches lo..hi (within the ring)."""
        if hi < lo:
            return 0
        i0, i1 = lo % RING, hi % RING
        ring = self._ring
        return ring[i0 : i1 + 1].count(1) if i0 <= i1 else ring[i0:].count(1) + ring[: i1 + 1].count(1)

    def _storm(self, seq: int, p: float) -> int | None:
        """The first dispatch of a window ending at `seq` with more refusals than the background rate `p`
        explains, over a few window sizes (a storm among the newest dispatches shows in the small ones at
        once); None if none has."""
        for m in (16, 64, RECENT):
            lo = max(seq - m + 1, self._ring_start, self._seq - RING)
            n = seq - lo + 1
            if n <= 0:
                break
            k = self._ring_count(lo, seq)
            if k > 1.5 * n * p + 3.0 * math.sqrt(n * p * (1.0 - p)) + 2.0:
                return lo
            if n < m:
                break
        return None

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
        if self.stats.decreases:
            gain = 1.0  # once a limit was met, probe gently
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
        phase = "slow start" if self.slow_start else "steady"
        return f"limit {self.window}/{self.ceiling} ({phase})"
