"""The shipped eagle3.yaml, unchanged, materialises every asset of a partition (hidden_states and the acceptance
gate included, on CPU for the embedded model) with every check green, and the result exports. A default that no
test runs is broken."""

from __future__ import annotations

import json
import shutil

import dagster as dg
import pytest

from eagle3_assets.config import load_config
from eagle3_assets.core.export import export
from eagle3_assets.definitions import build_definitions

from .conftest import REPO


@pytest.mark.slow
def test_the_shipped_config_materialises_every_asset_and_exports(tmp_path):
    shutil.copy(REPO / "eagle3.yaml", tmp_path / "eagle3.yaml")
    shutil.copytree(REPO / "prompts", tmp_path / "prompts")
    path = tmp_path / "eagle3.yaml"
    assert path.read_text() == (REPO / "eagle3.yaml").read_text()
    cfg = load_config(path)
    defs = build_definitions(cfg, str(path))
    job = defs.resolve_implicit_global_asset_job_def()
    with dg.instance_for_test() as instance:
        result = job.execute_in_process(
            partition_key="B3",
            instance=instance,
            # Six answers keep this test short (the acceptance gate trains on five, holds one out).
            run_config={"ops": {"responses": {"config": {"limit": 6}}}},
            raise_on_error=False,
        )
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    materialized = {m.asset_key.to_user_string() for m in result.asset_materializations_for_node("responses")}
    assert "responses" in materialized
    checks = {
        e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    }
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
    folder = tmp_path / "data" / "B3" / "hidden_states"
    assert (folder / "index.parquet").exists()
    out = tmp_path / "export"
    assert export(folder, out, "speculators", log=lambda m: None) == 6
    assert json.loads((out / "eagle3_config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [
        2,
        15,
        27,
    ]
