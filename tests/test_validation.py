"""The validation report and the rules behind the checks; a failing blocking check stops the flow in
Dagster."""

from __future__ import annotations

import json

import dagster as dg
import polars as pl
import pytest

from eagle3_assets.config import DatasetConfig
from eagle3_assets.core.report import validation
from eagle3_assets.core.report.summary import build_report, render_markdown, wilson_interval
from eagle3_assets.core.storage.tables import RESPONSE_SCHEMA, JournalTable
from eagle3_assets.core.tokens.answer_quality import is_degenerate

from .support.engine_runs import IMPORTED_AS_TARGET, SMOLLM2
from .support.projects import REPO, make_project, run_training_data_job, user_rows


def tokens_frame(rows: list[dict]) -> pl.DataFrame:
    base = {
        "id": "x",
        "input_ids": [1, 2],
        "loss_mask": [0, 1],
        "finish_reason": "stop",
        "reference_match": True,
        "match_explained": True,
        "mismatch": None,
    }
    return pl.DataFrame(
        [{**base, **r} for r in rows],
        schema_overrides={
            "input_ids": pl.List(pl.Int32),
            "loss_mask": pl.List(pl.Int8),
            "reference_match": pl.Boolean,
            "match_explained": pl.Boolean,
            "mismatch": pl.String,
        },
    )


def test_lengths_and_end_of_turn_rules():
    ok = tokens_frame([{"id": "a"}])
    assert validation.lengths_match(ok).passed
    assert not validation.lengths_match(tokens_frame([{"id": "b", "loss_mask": [0, 1, 1]}])).passed
    assert validation.end_of_turn_present(ok, eot_id=2).passed
    missing = tokens_frame([{"id": "c", "input_ids": [1, 5]}])
    v = validation.end_of_turn_present(missing, eot_id=2)
    assert not v.passed and v.metadata["missing_end_of_turn"] == 1 and "c" in v.metadata["examples"]
    untrained = tokens_frame([{"id": "d", "loss_mask": [1, 0]}])
    assert not validation.end_of_turn_present(untrained, eot_id=2).passed
    truncated = tokens_frame([{"id": "e", "input_ids": [1, 5], "finish_reason": "length"}])
    assert validation.end_of_turn_present(truncated, eot_id=2).passed


def test_reference_match_rule_allows_noise_and_truncation_tails_but_not_defects():
    def frame(n_ok, n_bad, kind="bpe_split"):
        rows = [{}] * n_ok + [
            {"reference_match": False, "match_explained": kind == "truncation_tail", "mismatch": kind}
        ] * n_bad
        return tokens_frame(rows)

    assert validation.reference_match(frame(27, 1), 0.99).passed  # 96% of 28: within noise of 99%
    assert not validation.reference_match(frame(900, 100), 0.99).passed  # 90% of 1000: a defect
    assert validation.reference_match(frame(900, 100, "truncation_tail"), 0.99).passed
    # Nothing to compare (a text backend): the check could not run, so it does not pass; it says why.
    no_refs = validation.reference_match(
        tokens_frame([{"reference_match": None, "match_explained": None}]), 0.99
    )
    assert not no_refs.passed and no_refs.metadata["verified"] is False
    assert "UNVERIFIED" in no_refs.metadata["note"]
    low, high = wilson_interval(27, 28)
    assert low < 27 / 28 < high


def test_degenerate_answers_are_detected():
    assert is_degenerate("The cat sat on the mat. " * 40)
    assert not is_degenerate("A short answer.")
    natural = (
        "Rivers carry sediment from mountains to the sea, shaping valleys and deltas over millennia. "
        "Floods renew farmland but also threaten towns built on the plains; engineers answer with levees, "
        "reservoirs and warning systems, each with costs that later generations inherit. Meanwhile fish "
        "migrate upstream, birds nest in reeds and people fish, swim and trade along the banks."
    )
    assert not is_degenerate(natural)
    # Natural prose: the long paragraphs of the documentation pages (tables and code blocks left out).
    pages = "\n\n".join(page.read_text() for page in sorted((REPO / "docs").glob("*.md")))
    paragraphs = [p for p in pages.split("\n\n") if not p.lstrip().startswith(("|", "```"))]
    long_prose = "\n\n".join(p for p in paragraphs if len(p) > 200)[:12000]
    code = (REPO / "eagle3_assets" / "core" / "target_model" / "chat.py").read_text()[:12000]
    assert len(long_prose) > 5000 and not is_degenerate(long_prose) and not is_degenerate(code)
    loop = "I will check the answer again. "
    for share, expected in ((0.5, False), (0.7, False), (0.9, True), (0.97, True)):
        n = int(len(long_prose) * share)
        text = long_prose[: len(long_prose) - n] + (loop * (n // len(loop) + 1))[:n]
        assert is_degenerate(text) is expected, share


def test_report_counts_finish_mix_duplicates_and_lengths(tmp_path):
    from eagle3_assets.core.storage.layout import DatasetLayout

    layout = DatasetLayout(tmp_path, "B1").ensure()
    pl.DataFrame({"id": ["a", "b", "c"], "messages": [[{"role": "user", "content": "q"}]] * 3}).write_parquet(
        layout.prompts
    )
    table = JournalTable(layout.responses_dir, RESPONSE_SCHEMA)
    rows = {k: [None] * 3 for k in RESPONSE_SCHEMA}
    rows.update(
        id=["a", "b", "a"],
        backend=["local"] * 3,
        model=["m"] * 3,
        content=["ok", "loop " * 200, "ok"],
        reasoning=["think", None, "think"],
        finish_reason=["stop", "length", "stop"],
        completion_tokens=[10, 100, 10],
        cost_usd=[0.01, 0.02, 0.01],
    )
    table.append(pl.DataFrame(rows, schema=RESPONSE_SCHEMA))
    pl.DataFrame(
        {
            "id": ["a", "b"],
            "n_tokens": [20, 140],
            "n_loss_tokens": [10, 100],
            "reference_match": [True, False],
            "match_explained": [True, True],
            "mismatch": [None, "truncation_tail"],
            "ids_source": ["reference"] * 2,
            "finish_reason": ["stop", "length"],
            # the text features the tokens stage records per answer
            "answer_empty": [False, False],
            "answer_degenerate": [False, True],
            "answer_has_reasoning": [True, False],
        }
    ).write_parquet(layout.tokens)
    report = build_report(layout, DatasetConfig(source="(in code)", format="messages", budget_tokens=1000))
    r = report.to_json()
    assert r["n_prompts"] == 3 and r["n_responses"] == 2 and r["duplicate_ids"]["responses_files"] == 1
    assert r["finish_reasons"] == {"stop": 1, "length": 1} and r["truncated_share"] == 0.5
    assert r["degenerate_answers"] == 1 and r["reasoning_share"] == 0.5
    assert r["completion_tokens"] == 110 and r["budget_used_share"] == 0.11 and r["cost_usd"] == 0.03
    assert r["reference_match_rate"] == 0.5 and r["reference_match_rate_excluding_truncation_tails"] == 1.0
    assert r["token_lengths"]["max"] == 140 and sum(h["count"] for h in r["token_length_histogram"]) == 2
    md = render_markdown(report)
    assert "█" in md and "## Finish reasons" in md and "truncation_tail" in md


def test_a_failing_blocking_check_keeps_the_report_from_being_built(tmp_path, smol_tok):
    from eagle3_assets.config import load_config
    from eagle3_assets.core.generation.importer import import_responses
    from eagle3_assets.core.storage.layout import DatasetLayout
    from resources import Target

    path = make_project(tmp_path, {"B1": {"rows": user_rows([f"question {i}" for i in range(12)])}})
    layout = DatasetLayout(tmp_path / "data", "B1")
    with dg.instance_for_test() as instance:
        assert run_training_data_job(path, "B1", instance, run_config=None, selection=["prompts"]).success
        chat = Target(load_config(path)).chat_tokenizer()
        wrong = smol_tok("Something else entirely.", add_special_tokens=False)["input_ids"]
        ids = pl.read_parquet(layout.prompts)["id"].to_list()
        src = tmp_path / "answers.jsonl"
        src.write_text(
            "\n".join(json.dumps({"id": i, "response": "The answer.", "output_ids": wrong}) for i in ids)
        )
        assert import_responses(layout, src, chat, IMPORTED_AS_TARGET, model=SMOLLM2).imported == 12
        result = run_training_data_job(path, "B1", instance)
        assert not result.success
        evaluations = {
            e.event_specific_data.check_name: e.event_specific_data.passed
            for e in result.all_events
            if e.event_type_value == "ASSET_CHECK_EVALUATION"
        }
        assert evaluations["tokens_reference_match"] is False
        assert not result.asset_materializations_for_node("validation_report")
    assert not layout.report_json.exists()


def test_prompts_not_empty_rule_names_the_rows_and_the_top_reasons():
    assert validation.prompts_present(3, ["duplicate of p0", "bad JSON: x at column 1"]).passed
    empty = validation.prompts_present(0, [])
    assert not empty.passed and empty.metadata["source_rows"] == 0
    assert empty.metadata["reason"] == "no prompts: the source has no rows"
    reasons = ["missing field 'messages' (a non-empty list)"] * 5 + [
        "duplicate of p1",
        "bad JSON: x at column 3",
    ]
    v = validation.prompts_present(0, reasons)
    assert not v.passed
    assert (v.metadata["source_rows"], v.metadata["quarantined"], v.metadata["duplicates"]) == (7, 6, 1)
    assert v.metadata["top_reasons"] == "missing field 'messages' (5); bad JSON: x (1)"
    assert "all 7 source rows were set aside" in v.metadata["reason"]
    # A share of nothing is not a pass either.
    assert not validation.failure_share(0, 0, 0.05).passed


@pytest.mark.parametrize(
    "rows", [[], ["not json", {"text": "no messages"}, {"messages": []}]], ids=["empty", "bad"]
)
def test_a_source_with_no_usable_row_fails_the_blocking_check_and_nothing_after_it_runs(tmp_path, rows):
    """An empty source, or one whose every row is quarantined, ends the run at `prompts_not_empty`: nothing
    is asked, and no later stage reports green over an empty table."""
    path = make_project(tmp_path, {"B1": {"rows": rows}})
    with dg.instance_for_test() as instance:
        result = run_training_data_job(path, "B1", instance)
    assert not result.success
    checks = {
        e.event_specific_data.check_name: e.event_specific_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    }
    check = checks["prompts_not_empty"]
    assert check.passed is False
    md = {k: v.value for k, v in check.metadata.items()}
    assert md["prompts"] == 0 and md["source_rows"] == len(rows) and md["quarantined"] == len(rows)
    if rows:
        assert "missing field 'messages'" in md["top_reasons"] and "bad JSON" in md["top_reasons"]
    assert not result.asset_materializations_for_node("responses")
    assert not result.asset_materializations_for_node("validation_report")


def test_the_report_of_a_partition_without_prompts_says_so_first(tmp_path):
    from eagle3_assets.core.storage.layout import DatasetLayout

    layout = DatasetLayout(tmp_path, "B1").ensure()
    pl.DataFrame(
        {"id": [], "messages": []}, schema={"id": pl.String, "messages": pl.List(pl.String)}
    ).write_parquet(layout.prompts)
    pl.DataFrame({"reason": ["bad JSON: x"] * 4}).write_parquet(layout.quarantine)
    report = build_report(layout, DatasetConfig(source="(in code)", format="messages"))
    md = render_markdown(report)
    assert md.splitlines()[2].startswith("**0 prompts: all 4 source rows were set aside")
