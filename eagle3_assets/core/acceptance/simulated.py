"""The acceptance length the draft's per-position accuracy implies, set beside the one an engine measures.

With k draft tokens per verifying forward, token j is accepted only if tokens 1..j were, so if step j's
accuracy is a_j the expected tokens per forward are 1 + sum over j of a_1 x ... x a_j. The rates here are
teacher-forced step accuracies (each step's share of right predictions over every answer position, its
earlier steps right or not), so the product assumes the steps' errors are independent: where a draft's errors
cluster on the same positions the served figure comes out higher, where they are spread out lower. The ratio
served / simulated is what says how far training-time accuracy can be trusted as a proxy.

Which rates: the heldout samples', teacher-forced through the trained draft without a gradient step (the same
prompts the engine then measures, never trained on), not the last training batch's (one batch of samples the
draft was just fitted to: an optimistic figure, and noisy). The training figure is logged while training and
kept in the training summary; the heldout one is the report's `simulated`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import BaseModel


def implied_acceptance_length(rates: Sequence[float], k: int | None = None) -> float:
    """1 + sum over j <= k of the product of the first j rates (a step with no counted position, NaN, ends the
    chain: nothing past it is known to be accepted)."""
    total, run = 1.0, 1.0
    for a in list(rates)[: len(rates) if k is None else k]:
        if math.isnan(a):
            break
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"an acceptance rate is within [0, 1]; got {a}")
        run *= a
        total += run
    return total


class SimulatedAcceptance(BaseModel):
    """report.json `simulated`: the acceptance length the heldout samples' step accuracies imply, beside the
    one the engine measured on the same prompts."""

    acceptance_length: float
    per_position: list[float]  # teacher-forced step accuracy, steps 1..k
    n_samples: int
    source: str  # which samples the rates come from, and how
    served_acceptance_length: float  # the engine's, heldout part
    served_over_simulated: float | None  # None where the simulated figure is 0 (never: it is >= 1)


def simulated_beside_served(
    per_position: Sequence[float], k: int, n_samples: int, served: float
) -> SimulatedAcceptance:
    rates = [0.0 if math.isnan(a) else round(float(a), 4) for a in list(per_position)[:k]]
    simulated = implied_acceptance_length(rates, k)
    return SimulatedAcceptance(
        acceptance_length=round(simulated, 4),
        per_position=rates,
        n_samples=n_samples,
        source="heldout samples' stored states, teacher-forced through the trained draft's k steps",
        served_acceptance_length=served,
        served_over_simulated=round(served / simulated, 4) if simulated > 0 else None,
    )
