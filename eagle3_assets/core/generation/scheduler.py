"""Which prompt goes out next across the lanes of one run, when a prompt is sent again, and when the
dispatcher must look again.

Lanes are served round robin, each within its own budget: a lane whose budget has no room for one more request
is passed over for the rest of the dispatcher's pass, and the others take the free slots. A lane stops alone
when its budget refuses a dispatch with nothing in flight, or when it closes out: its budget is committed to
what is in flight and mostly spent, so no trickle of single requests goes out as the last long answers land
(they would stretch the run's end for a fraction of a percent of its budget).

Sent again: a refused prompt after its own Retry-After, or a short delay that grows with its refusals; a
faulted one after a jittered exponential backoff, so that faults of one moment do not come back as a wave.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine_settings import EngineSettings
    from .lanes import Lane, LaneBudget, PendingPrompt

# A lane whose budget blocks dispatch once this share of it is committed (spent, or expected from what is in
# flight) and at least CLOSE_OUT_SPENT of it spent sends nothing more. The spent floor keeps a reservation
# that is still pessimistic (few answers known, a small budget under a wide window) from closing a lane early.
CLOSE_OUT_SHARE = 0.97
CLOSE_OUT_SPENT = 0.9
# Dispatches per pass of the dispatcher (or a sixteenth of the window): answers noticed together (a stream
# client reads in ticks) would otherwise release one large burst, all of it past a provider's cap before its
# first refusal could come back.
BURST = 16
IDLE_LOOK_S = 1.0  # the longest the dispatcher sleeps with nothing to wake it


def closing_out(budget: LaneBudget) -> bool:
    """Whether a lane whose budget just refused a dispatch, with answers still in flight, sends nothing
    more."""
    return budget.spent_share() >= CLOSE_OUT_SPENT and budget.committed_share() >= CLOSE_OUT_SHARE


class LaneScheduler:
    """The lanes of one run in turn, and the timing of every prompt sent again."""

    def __init__(self, lanes: Sequence[Lane], settings: EngineSettings):
        self.lanes = list(lanes)
        self.settings = settings
        self._turn = 0  # the lane whose turn it is to dispatch next

    @staticmethod
    def burst(window: int) -> int:
        return max(BURST, window // 16)

    @property
    def finished(self) -> bool:
        """Everything answered, failed or out of budget."""
        return all(lane.finished for lane in self.lanes)

    def start_pass(self) -> None:
        """A new pass of the dispatcher: every lane's budget is looked at again."""
        for lane in self.lanes:
            lane.budget_blocked = False

    def next(self, now: float) -> PendingPrompt | None:
        """The next attempt, lanes in turn; a lane whose budget has no room for one more request is passed
        over."""
        n = len(self.lanes)
        for i in range(n):
            lane = self.lanes[(self._turn + i) % n]
            if lane.budget_stop or lane.budget_blocked:
                continue
            p = lane.take(now)
            if p is None:
                continue
            if not lane.budget.can_dispatch():
                lane.put_back(p, now)
                lane.budget_blocked = True
                continue
            self._turn = (self._turn + i + 1) % n
            return p
        return None

    def stop_blocked_lanes(self) -> None:
        """After a pass: a lane blocked by its budget with nothing in flight, or closing out, stops."""
        for lane in self.lanes:
            if (
                lane.budget_blocked
                and not lane.budget_stop
                and (not lane.in_flight or closing_out(lane.budget))
            ):
                lane.budget_stop = True

    def next_timer(self, now: float, paused_until: float) -> float:
        """How long the dispatcher may sleep when nothing wakes it: until the next due retry or the end of a
        pause."""
        timers = [IDLE_LOOK_S]
        for lane in self.lanes:
            due = lane.next_retry_at
            if due is not None and not lane.budget_blocked:
                timers.append(due - now)
        if paused_until > now:
            timers.append(paused_until - now)
        return max(0.001, min(timers))

    def retry_refused(self, p: PendingPrompt, retry_after: float | None, now: float) -> None:
        """A prompt refused for capacity: sent again after the provider's Retry-After, or a growing delay."""
        s = self.settings
        if retry_after is None:
            cap = min(s.refused_delay_max_s, s.refused_delay_s * 1.5 ** (p.refusals - 1))
            retry_after = random.uniform(cap / 2, cap * 1.5)
        p.lane.retry_at(p, now + retry_after)

    def retry_faulted(self, p: PendingPrompt, retry_after: float | None, now: float) -> None:
        """A prompt that met a fault: jittered exponential backoff in [cap/4, cap], cap = min(max,
        base·2^(faults-1)), unless the provider named its own delay."""
        s = self.settings
        if retry_after is None:
            cap = min(s.backoff_max_s, s.backoff_base_s * 2 ** (p.faults - 1))
            retry_after = random.uniform(cap / 4, cap)
        p.lane.retry_at(p, now + retry_after)
