"""A partition materialised through Dagster's own API on the embedded model: outputs, resume, budget."""

from __future__ import annotations

import json

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.config import load_config
from eagle3_assets.definitions import build_definitions

from .support.projects import make_project, run_training_data_job, user_rows

QUESTIONS = [
    "What is the capital of France?",
    "Give me one word that rhymes with cat.",
    "What is 3 times 4?",
    "Name a planet.",
]


def materialization_metadata(result, asset):
    mats = [m for m in result.asset_materializations_for_node(asset)]
    return mats[-1].metadata


@pytest.fixture
def project(tmp_path):
    rows = [*user_rows(QUESTIONS), '{"messages": broken json']
    return make_project(
        tmp_path, {"B3": {"rows": rows, "max_tokens": 16}, "B4": {"rows": user_rows(["Hi"]), "max_tokens": 8}}
    )


def test_partition_materialises_end_to_end_and_resumes_without_repeating_work(project, tmp_path):
    with dg.instance_for_test() as instance:
        result = run_training_data_job(project, "B3", instance)
        assert result.success
        root = tmp_path / "data" / "B3"
        prompts = pl.read_parquet(root / "prompts.parquet")
        assert prompts.height == 4
        assert pl.read_parquet(root / "quarantine.parquet")["reason"].str.contains("bad JSON").all()
        responses = pl.read_parquet(root / "responses" / "*.parquet")
        assert sorted(responses["id"]) == sorted(prompts["id"])
        for col in (
            "id",
            "backend",
            "model",
            "provider",
            "content",
            "reasoning",
            "finish_reason",
            "prompt_tokens",
            "completion_tokens",
            "cost_usd",
            "output_ids",
        ):
            assert col in responses.columns
        assert responses.schema["output_ids"] == pl.List(pl.Int32)
        assert set(responses["backend"]) == {"local"}
        tokens = pl.read_parquet(root / "tokens.parquet")
        assert tokens.schema["input_ids"] == pl.List(pl.Int32) and tokens.schema["loss_mask"] == pl.List(
            pl.Int8
        )
        assert (tokens["input_ids"].list.len() == tokens["loss_mask"].list.len()).all()
        assert tokens["reference_match"].is_not_null().all()
        report = json.loads((root / "report.json").read_text())
        for k in (
            "n_prompts",
            "n_responses",
            "n_failures",
            "budget_tokens",
            "completion_tokens",
            "cost_usd",
            "reference_match_rate",
        ):
            assert k in report
        assert report["n_prompts"] == 4 and report["n_responses"] == 4
        assert report["completion_tokens"] == int(responses["completion_tokens"].sum())
        checks = [e for e in result.all_events if e.event_type_value == "ASSET_CHECK_EVALUATION"]
        assert len(checks) >= 5
        # SmolLM2's ChatML template is proven to write texts verbatim: no row was rendered a second time.
        assert materialization_metadata(result, "tokens")["template_check"].value == "proven verbatim once"

        files_before = sorted(p.name for p in (root / "responses").glob("*.parquet"))
        again = run_training_data_job(project, "B3", instance)
        assert again.success
        md = materialization_metadata(again, "responses")
        assert md["sent_this_run"].value == 0 and md["answered_before_this_run"].value == 4
        assert sorted(p.name for p in (root / "responses").glob("*.parquet")) == files_before
        assert pl.read_parquet(root / "responses" / "*.parquet").equals(responses)


def test_budget_stops_dispatch(tmp_path):
    rows = user_rows([f"Write a long story about the number {i}." for i in range(12)])
    path = make_project(
        tmp_path,
        {"B1": {"rows": rows, "max_tokens": 16, "budget_tokens": 40}},
        backends={"local": {"batch_size": 2}},
    )
    with dg.instance_for_test() as instance:
        result = run_training_data_job(path, "B1", instance)
        assert result.success
    responses = pl.read_parquet(tmp_path / "data" / "B1" / "responses" / "*.parquet")
    # Reservation starts at max_tokens per request in flight, so the budget is never exceeded.
    assert 0 < responses.height < 12
    assert responses["completion_tokens"].sum() <= 40
    report = json.loads((tmp_path / "data" / "B1" / "report.json").read_text())
    assert report["budget_tokens"] == 40 and report["completion_tokens"] <= 40


def test_a_run_over_several_partitions_generates_them_together_and_reports_each(project, tmp_path):
    """What a backfill of several datasets becomes (single-run backfill policy): one run, one engine, and
    still a materialisation with its own metadata, and check results, for every partition."""
    with dg.instance_for_test() as instance:
        for key in ("B3", "B4"):
            assert run_training_data_job(project, key, instance, selection=["prompts"]).success
        defs = build_definitions(load_config(project), str(project))
        job = defs.resolve_implicit_global_asset_job_def()
        result = job.execute_in_process(
            instance=instance,
            asset_selection=[dg.AssetKey("responses")],
            tags={"dagster/asset_partition_range_start": "B3", "dagster/asset_partition_range_end": "B4"},
            raise_on_error=False,
        )
        assert result.success, [e.message for e in result.all_events if e.is_failure]
        mats = {m.partition: m.metadata for m in result.asset_materializations_for_node("responses")}
        assert set(mats) == {"B3", "B4"}
        assert mats["B3"]["answered_total"].value == 4 and mats["B4"]["answered_total"].value == 1
        assert mats["B3"]["datasets_in_this_run"].value == "B3, B4"
        startup = mats["B3"]["startup_s"].value
        assert startup["launch_to_first_request_s"] >= startup["step_to_first_request_s"] > 0
        evaluations = [
            e.asset_check_evaluation_data
            for e in result.all_events
            if e.event_type_value == "ASSET_CHECK_EVALUATION"
        ]
        per_partition = {(ev.check_name, ev.partition) for ev in evaluations if ev.partition}
        for check in ("responses_unique_ids", "responses_failure_share"):
            assert {(check, "B3"), (check, "B4")} <= per_partition
        for key, n in (("B3", 4), ("B4", 1)):
            assert pl.read_parquet(tmp_path / "data" / key / "responses" / "*.parquet").height == n
