"""The acceptance length implied by per-position accuracy (core/acceptance/simulated.py): 1 + the sum over j
of the product of the first j rates, on known rates."""

from __future__ import annotations

import math

import pytest

from eagle3_assets.core.acceptance.simulated import implied_acceptance_length, simulated_beside_served


def test_known_rates() -> None:
    assert implied_acceptance_length([1.0, 1.0, 1.0, 1.0]) == 5.0  # every draft token accepted: k + 1
    assert implied_acceptance_length([0.0, 1.0, 1.0]) == 1.0  # the first rejected: only the target's token
    assert implied_acceptance_length([0.5, 0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert implied_acceptance_length([0.8, 0.5, 0.25]) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    # Only the first k rates count; a step with nothing counted ends the chain.
    assert implied_acceptance_length([0.5, 0.5, 0.5], k=2) == pytest.approx(1.75)
    assert implied_acceptance_length([0.5, math.nan, 0.9]) == pytest.approx(1.5)
    with pytest.raises(ValueError, match="within"):
        implied_acceptance_length([0.5, 1.5])


def test_beside_served() -> None:
    s = simulated_beside_served([0.8, 0.5, math.nan, 0.9], k=3, n_samples=4, served=2.1)
    assert s.per_position == [0.8, 0.5, 0.0]
    assert s.acceptance_length == pytest.approx(2.2)
    assert s.served_over_simulated == pytest.approx(round(2.1 / 2.2, 4))
    assert 0 < s.acceptance_length <= 3 + 1
