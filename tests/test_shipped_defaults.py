"""The shipped eagle3.yaml, unchanged, materialises every asset of a partition (hidden_states and the
acceptance gate included, on CPU for the embedded model) with every check green, and the result exports. A
default that no test runs is broken. (The run itself is the session fixture `shipped_b3`, which the training
frameworks' tests read too.)"""

from __future__ import annotations

import json

import pytest

from eagle3_assets.core.hidden_states.exports.export import export


@pytest.mark.slow
def test_the_shipped_config_materialises_every_asset_and_exports(shipped_b3, tmp_path):
    assert shipped_b3.success, shipped_b3.failures
    assert "responses" in shipped_b3.materialized
    checks = shipped_b3.checks
    expected = {
        "responses_unique_ids",
        "responses_failure_share",
        "tokens_lengths_match",
        "tokens_reference_match",
        "tokens_coverage",
        "tokens_end_of_turn",
        "hidden_states_coverage",
        "hidden_states_ids_match",
        "hidden_states_finite",
        "hidden_states_consistent",
        "hidden_states_spot_check",
        "acceptance_gate",
    }
    assert expected <= set(checks)
    assert all(checks[name].passed for name in expected), {
        n: checks[n].metadata for n in expected if not checks[n].passed
    }
    folder = shipped_b3.layout.hidden_states_dir
    assert (folder / "index.parquet").exists()
    out = tmp_path / "export"
    assert export(folder, out, "speculators", log=lambda m: None) == 6
    assert json.loads((out / "eagle3_config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [
        2,
        15,
        27,
    ]
