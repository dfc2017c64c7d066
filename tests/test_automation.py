"""Scheduled top-ups: only datasets under budget with work left; downstream follows, never past a failed
check."""

from __future__ import annotations

import datetime as dt
import json

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.config import load_config
from eagle3_assets.core.generation.importer import import_responses
from eagle3_assets.core.prompts.ingest import write_prompts
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.definitions import build_definitions

from .support.engine_runs import IMPORTED_AS_TARGET, SMOLLM2
from .support.projects import make_project, user_rows

T0 = dt.datetime(2026, 11, 29, 10, 1, tzinfo=dt.UTC)


def ingest(cfg, key) -> DatasetLayout:
    layout = DatasetLayout(cfg.storage_root, key).ensure()
    section = cfg.datasets[key]  # format messages, no fields or system prompt (make_project's defaults)
    write_prompts(cfg.resolve_path(section.source), layout, section)
    return layout


def answer_all(layout, chat, tmp_path, tokens_each=3, output_ids=None):
    ids = pl.read_parquet(layout.prompts)["id"].to_list()
    src = tmp_path / f"{layout.key}-answers.jsonl"
    rows = [{"id": i, "response": "Done.", "usage": {"completion_tokens": tokens_each}} for i in ids]
    if output_ids is not None:
        for r in rows:
            r["output_ids"] = output_ids
    src.write_text("\n".join(json.dumps(r) for r in rows))
    import_responses(layout, src, chat, IMPORTED_AS_TARGET, model=SMOLLM2)


def requested(result, asset: str) -> set[str]:
    return set(result.get_requested_partitions(dg.AssetKey(asset)))


def test_top_up_requests_datasets_under_budget_and_downstream_follows(tmp_path, chat):
    path = make_project(
        tmp_path,
        {
            "B1": {"rows": user_rows(["a", "b", "c"])},  # never ingested: under budget, work left
            "B2": {"rows": user_rows(["d", "e"])},  # every prompt answered
            "B3": {"rows": user_rows(["f", "g"]), "budget_tokens": 5},  # budget met by earlier answers
            "B4": {"rows": user_rows(["h", "i"])},  # half answered: work left
        },
        automation={"top_up_cron": "*/5 * * * *"},
    )
    cfg = load_config(path)
    answer_all(ingest(cfg, "B2"), chat, tmp_path)
    b3 = ingest(cfg, "B3")
    answer_all(b3, chat, tmp_path, tokens_each=4)
    b4 = ingest(cfg, "B4")
    first = pl.read_parquet(b4.prompts)["id"][0]
    (tmp_path / "b4.jsonl").write_text(json.dumps({"id": first, "response": "x"}))
    import_responses(b4, tmp_path / "b4.jsonl", chat, IMPORTED_AS_TARGET, model=SMOLLM2)

    defs = build_definitions(cfg, str(path))
    with dg.instance_for_test() as instance:
        r = dg.evaluate_automation_conditions(defs=defs, instance=instance, evaluation_time=T0)
        r = dg.evaluate_automation_conditions(
            defs=defs, instance=instance, cursor=r.cursor, evaluation_time=T0 + dt.timedelta(minutes=5)
        )
        # prompts: only B1 (never ingested); B4's source did not change, so it is not ingested again.
        assert requested(r, "prompts") == {"B1"}
        # responses: where generation has work (B1, and B4 half answered); B2 (all answered) and B3 (budget
        # met) stay put. tokens waits for a changed responses version and its blocking checks, on a later
        # tick.
        assert requested(r, "responses") == {"B1", "B4"}
        assert not requested(r, "tokens")
        assert not requested(
            r, "hidden_states"
        )  # GPU stage: automatic only when automation.hidden_states is on
        r = dg.evaluate_automation_conditions(
            defs=defs, instance=instance, cursor=r.cursor, evaluation_time=T0 + dt.timedelta(minutes=6)
        )
        assert not requested(r, "prompts") and not requested(r, "responses")  # once per cron tick


def test_a_tick_with_nothing_to_do_runs_nothing_and_an_unchanged_stage_stops_the_flow(tmp_path, chat):
    path = make_project(
        tmp_path, {"B1": {"rows": user_rows(["alpha", "beta"])}}, automation={"top_up_cron": "*/5 * * * *"}
    )
    cfg = load_config(path)
    layout = ingest(cfg, "B1")
    answer_all(layout, chat, tmp_path)
    defs = build_definitions(cfg, str(path))
    job = defs.resolve_implicit_global_asset_job_def()
    with dg.instance_for_test() as instance:
        for asset in ("prompts", "responses", "tokens", "validation_report"):
            assert job.execute_in_process(
                partition_key="B1", instance=instance, asset_selection=[dg.AssetKey(asset)]
            ).success
        r = dg.evaluate_automation_conditions(defs=defs, instance=instance, evaluation_time=T0)
        for minutes in (5, 10):  # two cron ticks: every prompt answered, the source unchanged
            r = dg.evaluate_automation_conditions(
                defs=defs,
                instance=instance,
                cursor=r.cursor,
                evaluation_time=T0 + dt.timedelta(minutes=minutes),
            )
            assert r.total_requested == 0, [a for a in ("prompts", "responses", "tokens") if requested(r, a)]
        # responses materialised again by hand but bought nothing: same data version, so tokens does not
        # follow.
        assert job.execute_in_process(
            partition_key="B1", instance=instance, asset_selection=[dg.AssetKey("responses")]
        ).success
        r = dg.evaluate_automation_conditions(
            defs=defs, instance=instance, cursor=r.cursor, evaluation_time=T0 + dt.timedelta(minutes=11)
        )
        assert not requested(r, "tokens") and not requested(r, "validation_report")


@pytest.mark.parametrize(("bad_ids", "backend"), [(True, "local"), (False, "local"), (False, "openrouter")])
def test_nothing_flows_past_a_failed_blocking_check(tmp_path, chat, smol_tok, bad_ids, backend):
    path = make_project(
        tmp_path,
        {"B1": {"rows": user_rows(["alpha", "beta", "gamma", "delta"])}},
        automation={"top_up_cron": "*/5 * * * *"},
        backend=backend,
    )
    cfg = load_config(path)
    layout = ingest(cfg, "B1")
    wrong = smol_tok("Something else.", add_special_tokens=False)["input_ids"]
    answer_all(
        layout, chat, tmp_path, output_ids=wrong if bad_ids else None
    )  # wrong: the text does not match
    defs = build_definitions(cfg, str(path))
    job = defs.resolve_implicit_global_asset_job_def()
    with dg.instance_for_test() as instance:
        for asset in ("prompts", "responses"):
            assert job.execute_in_process(
                partition_key="B1", instance=instance, asset_selection=[dg.AssetKey(asset)]
            ).success
        r = dg.evaluate_automation_conditions(defs=defs, instance=instance, evaluation_time=T0)
        tokens_run = job.execute_in_process(
            partition_key="B1",
            instance=instance,
            raise_on_error=False,
            asset_selection=[dg.AssetKey("tokens")],
        )
        checks = {
            e.event_specific_data.check_name: e.event_specific_data
            for e in tokens_run.all_events
            if e.event_type_value == "ASSET_CHECK_EVALUATION"
        }
        match = checks["tokens_reference_match"]
        if bad_ids:  # compared, and wrong: an error that blocks
            assert not match.passed and match.severity == dg.AssetCheckSeverity.ERROR
        else:  # nothing to compare with (text only): it could not run, says so, and does not pass
            assert not match.passed and match.severity == dg.AssetCheckSeverity.WARN
            assert "UNVERIFIED" in match.description and match.metadata["verified"].value is False
        assert match.blocking == (backend != "openrouter")
        r = dg.evaluate_automation_conditions(
            defs=defs, instance=instance, cursor=r.cursor, evaluation_time=T0 + dt.timedelta(seconds=30)
        )
        # tokens was updated: the report follows only if its blocking checks passed. A backend that returns
        # ids (local) never leaves a partition without them: text-only answers there (an import) hold the
        # report until someone looks. A text backend's check never blocks: it has nothing to compare, ever.
        assert requested(r, "validation_report") == ({"B1"} if backend == "openrouter" else set())
