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
    assert {"responses", "hidden_states", "acceptance", "data_value"} <= shipped_b3.materialized
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


@pytest.mark.slow
def test_the_shipped_data_value_section_measures_drafts_on_the_suite(shipped_b3):
    """The shipped data_value section, run by the same job over B3 alone: the suite answered by the embedded
    target, B3's draft and the floor measured on it, and `all` (the same data as B3) reported without a second
    training."""
    from eagle3_assets.assets.data_value import read_value_report
    from eagle3_assets.config import load_config

    report = read_value_report(load_config(shipped_b3.root / "eagle3.yaml"))
    assert report is not None
    rows = {r.draft: r for r in report.rows}
    assert set(rows) == {"B3", "all", "untrained"}
    assert report.suite.n_prompts == 8 and report.suite.answers is not None
    assert report.suite.answers.answers == 8
    assert any(f.startswith("same-data") for f in rows["all"].flags)
    assert rows["all"].acceptance_length == rows["B3"].acceptance_length
    assert all(len(r.per_position) > 0 for r in rows.values())
