"""When the engine's event loop was last free, so that an answer read late is timed as landing early.

The budget learns each answer's latency and conditions on it (long answers land last). When the loop is held
up (its client starved of CPU, a long pass over many answers), answers pile up unread: a short answer read
late and timed when it was read poses as a long one, and lowers what the answers still in flight are expected
to need (at 2000 in flight on a busy machine the budget overshoots by 2-3%). The loop notes every TICK_S that
it is free; an answer read long after the last note may have landed at any time since, and is timed as the
earliest it could be, which errs on the budget's safe side.
"""

from __future__ import annotations

from collections.abc import Callable

TICK_S = 0.01  # how often the loop notes that it is free


class LoopHeartbeat:
    """The loop's last free moment, and the latency an answer is learned at when it is read."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.last_free = clock()

    def beat(self) -> None:
        self.last_free = self.clock()

    def latency_to_learn(self, now: float, dispatched_at: float) -> float:
        """As read, unless the loop was held up since its last beat: then from the earliest moment it could
        have landed."""
        earliest = self.last_free + TICK_S
        return now - dispatched_at if now <= earliest else max(earliest - dispatched_at, 0.001)
