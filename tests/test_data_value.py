"""data_value on the real embedded target, through Dagster: two small partitions (chat and code) answered,
their states extracted, then the asset trains a draft per partition, on all and on all but each, measures them
on a common suite and prices them. A suite prompt that is also a training prompt is refused, naming the rows,
before any training; the price columns follow the stored answers' costs; decoded outputs made to loop are
flagged; the asset without a data_value section says it is not configured and its check fails."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import dagster as dg
import polars as pl
import pytest
import yaml

from eagle3_assets.config import load_config
from eagle3_assets.core.data_value.loops import is_loop, looping_prompts
from eagle3_assets.core.data_value.pricing import price_of_gain
from eagle3_assets.core.data_value.run import Measurement, draft_plans, loop_flags
from eagle3_assets.core.data_value.suite import Suite, SuitePrompt, overlaps
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.definitions import (
    DATA_VALUE_JOB,
    HIDDEN_STATES_JOB,
    TRAINING_DATA_JOB,
    build_definitions,
)

from .support.projects import REPO, write_jsonl

# Six drafts (and the floor) trained and measured on 2 cores: a few minutes alone, far more beside a full
# suite run; the timeout leaves room for the latter.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

ACCEPTANCE = {"train_prompts": 5, "draft_tokens": 2, "max_new_tokens": 16, "train_steps": 40}
SUITE = [
    "Write a Python function that checks whether a string is a palindrome.",
    "What are three tips for sleeping better?",
]
KEYS = ("B1", "B3")
COSTS = {"B1": 0.002, "B3": 0.005}  # USD per stored answer, written into the answers before data_value runs


def _config(root: Path, suite: dict | None, leave_one_out: bool = True, name: str = "eagle3.yaml") -> Path:
    cfg: dict = {
        "storage": {"root": "data"},
        "datasets": {
            "B1": {"source": "B1.jsonl", "format": "sharegpt", "max_tokens": 24},
            "B3": {"source": "B3.jsonl", "format": "instruction", "max_tokens": 24},
        },
        "acceptance": ACCEPTANCE,
    }
    if suite is not None:
        cfg["data_value"] = {"suite": suite, "leave_one_out": leave_one_out}
    path = root / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _data_value(path: Path, instance: dg.DagsterInstance) -> dg.ExecuteInProcessResult:
    defs = build_definitions(load_config(path), str(path))
    return defs.resolve_job_def(DATA_VALUE_JOB).execute_in_process(instance=instance, raise_on_error=False)


def _set_costs(layout: DatasetLayout, usd: float) -> tuple[float, int]:
    """Every stored answer of the partition costs `usd`; returns the partition's total and its tokens."""
    total, tokens = 0.0, 0
    for f in sorted(layout.responses_dir.glob("*.parquet")):
        df = pl.read_parquet(f).with_columns(pl.lit(usd, pl.Float64).alias("cost_usd"))
        df.write_parquet(f)
        total += usd * df.height
        tokens += int(df["completion_tokens"].sum())
    return total, tokens


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    """B1 and B3, 6 answers each from the embedded target, their states; known costs on their answers."""
    root = tmp_path_factory.mktemp("data_value")
    for k in KEYS:
        shutil.copy(REPO / "prompts" / f"{k}.jsonl", root / f"{k}.jsonl")
    write_jsonl(
        root / "suite.jsonl",
        [{"id": f"s{i}", "messages": [{"role": "user", "content": t}]} for i, t in enumerate(SUITE)],
    )
    path = _config(root, {"source": "suite.jsonl", "format": "messages", "max_prompts": 2})
    defs = build_definitions(load_config(path), str(path))
    paid = {}
    with dg.instance_for_test() as instance:
        for key in KEYS:
            for job, run_config in (
                (TRAINING_DATA_JOB, {"ops": {"responses": {"config": {"limit": 6}}}}),
                (HIDDEN_STATES_JOB, None),
            ):
                result = defs.resolve_job_def(job).execute_in_process(
                    partition_key=key, instance=instance, run_config=run_config, raise_on_error=False
                )
                assert result.success, (job, [e.message for e in result.all_events if e.is_failure])
            paid[key] = _set_costs(DatasetLayout(root / "data", key), COSTS[key])
        result = _data_value(path, instance)
        assert result.success, [e.message for e in result.all_events if e.is_failure]
        yield root, path, instance, result, paid


def test_report_has_a_row_per_partition_all_and_all_but_each(project):
    root, _, instance, result, _ = project
    report = json.loads((root / "data" / "data_value" / "report.json").read_text())
    assert report["suite"]["n_prompts"] == 2 and report["suite"]["source"] == "suite.jsonl"
    rows = {r["draft"]: r for r in report["rows"]}
    assert set(rows) == {"untrained", "B1", "B3", "all", "all-but-B1", "all-but-B3"}
    contract = {
        "draft",
        "acceptance_length",
        "per_position",
        "cost_usd",
        "completion_tokens",
        "gpu_seconds",
        "usd_per_0_1_acceptance",
        "flags",
    }
    for r in rows.values():
        assert contract <= set(r)
        assert len(r["per_position"]) == ACCEPTANCE["draft_tokens"]
        assert 1.0 <= r["acceptance_length"] <= ACCEPTANCE["draft_tokens"] + 1
    assert rows["all-but-B1"]["datasets"] == ["B3"] and rows["all"]["datasets"] == ["B1", "B3"]
    # All but B1 is B3's own draft: reported under both names, trained and measured once.
    same = rows["all-but-B1"]
    assert same["acceptance_length"] == rows["B3"]["acceptance_length"]
    assert same["training_seconds"] == rows["B3"]["training_seconds"]
    assert any(f.startswith("same-data: the draft of B3") for f in same["flags"])
    assert not any(f.startswith("same-data") for f in rows["all"]["flags"])
    logs = [e.user_message for e in instance.all_logs(result.run_id)]
    assert any("data_value all:" in m for m in logs)  # what the gate's bench logs while it trains a draft
    assert not any("data_value all-but-B1:" in m or "data_value all-but-B3:" in m for m in logs)
    # A trained draft beats the untrained one on a suite it never saw.
    floor = report["floor_acceptance_length"]
    assert rows["all"]["acceptance_length"] > floor
    assert rows["B1"]["training_seconds"] > 0 and rows["B1"]["gpu_seconds"] >= rows["B1"]["training_seconds"]
    assert rows["B1"]["extraction_seconds"] > 0  # read from hidden_states' materialisations
    # The suite answered by the target like a partition (its own journal, the configured backend), and
    # every greedy speculative output equal to the target's answer.
    answers = [
        json.loads(a) for a in (root / "data" / "data_value" / "suite_answers.jsonl").read_text().splitlines()
    ]
    assert [a["id"] for a in answers] == ["s0", "s1"] and {a["source"] for a in answers} == {"target"}
    journal = pl.read_parquet(root / "data" / "data_value" / "suite" / "responses" / "*.parquet")
    assert sorted(journal["id"]) == ["s0", "s1"] and set(journal["backend"]) == {"local"}
    assert [a["text"] for a in answers] == [
        journal.filter(pl.col("id") == a["id"])["content"].item() for a in answers
    ]
    cost = report["suite"]["answers"]
    assert cost["answers"] == 2 and cost["sent_this_run"] == 2 and cost["backend"] == "local"
    assert cost["greedy"] is True and cost["completion_tokens"] == int(journal["completion_tokens"].sum())
    for r in rows.values():
        assert r["differs_from_target"] == [], (r["draft"], r["flags"])
    md = (root / "data" / "data_value" / "report.md").read_text()
    assert "| all |" in md and "| untrained |" in md
    meta = result.asset_materializations_for_node("data_value")[-1].metadata
    assert meta["status"].value == "measured" and "| B3 |" in meta["drafts"].value
    checks = {
        e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    }
    assert "data_value_drafts_beat_floor" in checks


def test_price_columns_follow_the_stored_answers_costs(project):
    root, _, _, _, paid = project
    report = json.loads((root / "data" / "data_value" / "report.json").read_text())
    rows = {r["draft"]: r for r in report["rows"]}
    floor = report["floor_acceptance_length"]
    for draft, keys in (("B1", ["B1"]), ("B3", ["B3"]), ("all", ["B1", "B3"]), ("all-but-B3", ["B1"])):
        r = rows[draft]
        assert r["cost_usd"] == pytest.approx(sum(paid[k][0] for k in keys))
        assert r["completion_tokens"] == sum(paid[k][1] for k in keys)
        gain = r["acceptance_length"] - floor
        if gain > 0:
            assert r["usd_per_0_1_acceptance"] == pytest.approx(r["cost_usd"] / (gain / 0.1), rel=1e-4)
        else:
            assert r["usd_per_0_1_acceptance"] is None and any(f.startswith("no-gain") for f in r["flags"])
    assert rows["untrained"]["usd_per_0_1_acceptance"] is None


def test_price_of_gain_arithmetic_and_its_nulls():
    assert price_of_gain(1.0, 1.5, 1.0).usd_per_0_1_acceptance == pytest.approx(0.2)
    assert price_of_gain(3.0, 2.2, 1.6).usd_per_0_1_acceptance == pytest.approx(0.5)
    free = price_of_gain(0.0, 2.0, 1.0)
    assert free.usd_per_0_1_acceptance is None and free.flags[0].startswith("no-cost")
    lost = price_of_gain(1.0, 1.0, 1.2)
    assert lost.usd_per_0_1_acceptance is None and lost.flags[0].startswith("no-gain")


def test_loop_detection_on_decoded_outputs(smol_tok):
    tok = smol_tok
    loop = tok.encode("la la la " * 20)
    prose = tok.encode(
        "Sleep at the same time each night, keep the bedroom dark and cool, and avoid screens and caffeine "
        "in the hour before bed; a short walk in daylight helps too."
    )
    assert is_loop(tok.decode(loop)) and not is_loop(tok.decode(prose))
    assert looping_prompts(["a", "b"], [prose, loop], tok.decode) == ["b"]
    m = Measurement(2.5, [0.9, 0.5], [], 1.0, without_loops=1.4, looping=["b"])
    assert loop_flags(m, 2) == [
        "degenerate-loop: 1 of 2 suite outputs loop (b); acceptance length without them: 1.400"
    ]
    assert loop_flags(Measurement(1.5, [0.3], [], 1.0), 2) == []


def test_an_overlapping_suite_is_refused_naming_the_rows(project):
    root, _, instance, _, _ = project
    b1 = json.loads((root / "B1.jsonl").read_text().splitlines()[0])
    text = b1["conversations"][0]["value"]
    # The same question with other capitals and spacing is the same question.
    write_jsonl(
        root / "overlap.jsonl",
        [
            {"id": "fresh", "messages": [{"role": "user", "content": "Name a prime number above 100."}]},
            {"id": "copied", "messages": [{"role": "user", "content": "  " + text.upper() + " "}]},
        ],
    )
    report = root / "data" / "data_value" / "report.json"
    before = report.stat().st_mtime_ns
    path = _config(root, {"source": "overlap.jsonl"}, name="overlap.yaml")
    result = _data_value(path, instance)
    assert not result.success
    failure = result.failure_data_for_node("data_value")
    assert failure is not None and failure.error is not None
    message = failure.error.to_string()
    assert (
        f"suite copied = B1/{b1['id']} (same normalised text)" in message and "nothing was trained" in message
    )
    assert report.stat().st_mtime_ns == before  # refused before any training: the stored report stands


def test_overlap_by_fingerprint_and_draft_plans():
    suite = Suite("x", [SuitePrompt("s", [{"role": "user", "content": "Hi there"}])])
    from eagle3_assets.core.prompts.fingerprints import prompt_fingerprint

    msgs = [{"role": "user", "content": "Hi there"}]
    df = pl.DataFrame({"id": ["p1", "p2"], "messages": [msgs, [{"role": "user", "content": "Other"}]]})
    df = df.with_columns(pl.Series("fingerprint", [prompt_fingerprint(msgs), None]))
    found = overlaps(suite, {"B9": df})
    assert [str(o) for o in found] == ["suite s = B9/p1 (same fingerprint)"]
    names = [p.name for p in draft_plans(["A", "B", "C"], True)]
    assert names == ["A", "B", "C", "all", "all-but-A", "all-but-B", "all-but-C"]
    assert [p.name for p in draft_plans(["A"], True)] == ["A", "all"]


def test_without_a_section_the_asset_says_not_configured_and_its_check_fails(project):
    root, _, instance, _, _ = project
    path = _config(root, None, name="plain.yaml")
    result = _data_value(path, instance)
    assert result.success
    meta = result.asset_materializations_for_node("data_value")[-1].metadata
    assert meta["status"].value.startswith("not configured")
    check = next(
        e.asset_check_evaluation_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    )
    assert not check.passed and check.metadata["reason"].value.startswith("not configured")


# Data versioning: these run last (they rewrite the module's report).


def test_a_rerun_with_nothing_changed_trains_nothing_and_re_reports(project):
    root, path, instance, first, _ = project
    report = root / "data" / "data_value" / "report.json"
    before, text = report.stat().st_mtime_ns, report.read_text()
    # A no-op extraction run rewrites its plan (a new timestamp): not an input of the report.
    plan = DatasetLayout(root / "data", "B1").extraction_plan
    assert plan.exists()
    plan.write_text(plan.read_text() + "\n")
    result = _data_value(path, instance)
    assert result.success
    meta = result.asset_materializations_for_node("data_value")[-1].metadata
    assert meta["reused"].value is True and meta["status"].value.startswith("reused")
    assert (
        meta["inputs_version"].value
        == first.asset_materializations_for_node("data_value")[-1].metadata["inputs_version"].value
    )
    assert report.stat().st_mtime_ns == before and report.read_text() == text
    logs = [e.user_message for e in instance.all_logs(result.run_id)]
    assert any("inputs unchanged" in m for m in logs)
    assert not any("data_value all:" in m for m in logs)  # no draft was trained
    assert any("all 2 prompts are answered" in m for m in logs)  # the suite's answers were not bought again


def test_a_changed_input_reruns(project):
    """One more answer's cost in B3 (its answers changed), one suite prompt fewer, and the target's stored
    answer to s0 edited: each names itself, the report is computed again, nothing is bought again, and the
    drafts' outputs are compared with the edited answer (flagged: not the target's)."""
    root, _, instance, _, paid = project
    _set_costs(DatasetLayout(root / "data", "B3"), 2 * COSTS["B3"])
    suite_journal = DatasetLayout(root / "data" / "data_value", "suite").responses_dir
    for f in sorted(suite_journal.glob("*.parquet")):
        df = pl.read_parquet(f)
        edited = df.with_columns(
            pl.when(pl.col("id") == "s0")
            .then(pl.col("output_ids").list.eval(pl.element() + 1))
            .otherwise(pl.col("output_ids"))
            .alias("output_ids")
        )
        edited.write_parquet(f)
    path = _config(
        root,
        {"source": "suite.jsonl", "format": "messages", "max_prompts": 1},
        leave_one_out=False,
        name="changed.yaml",
    )
    result = _data_value(path, instance)
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    meta = result.asset_materializations_for_node("data_value")[-1].metadata
    assert meta["reused"].value is False
    assert set(meta["inputs_changed"].value) == {"partition:B3", "settings", "suite_answers"}
    report = json.loads((root / "data" / "data_value" / "report.json").read_text())
    assert report["suite"]["n_prompts"] == 1 and report["suite"]["answers"]["sent_this_run"] == 0
    rows = {r["draft"]: r for r in report["rows"]}
    assert set(rows) == {"untrained", "B1", "B3", "all"}
    for r in rows.values():
        assert r["differs_from_target"] == ["s0"]
        assert any(f.startswith("differs-from-target: 1 of 1") for f in r["flags"])
    assert rows["B3"]["cost_usd"] == pytest.approx(2 * paid["B3"][0])


def test_a_dataset_held_out_as_the_suite_and_the_sections_rules(tmp_path):
    from eagle3_assets.config import ConfigError
    from eagle3_assets.core.data_value.suite import load_suite

    shutil.copy(REPO / "prompts" / "B3.jsonl", tmp_path / "B3.jsonl")
    shutil.copy(REPO / "prompts" / "B1.jsonl", tmp_path / "B1.jsonl")
    suite = load_suite(load_config(_config(tmp_path, {"dataset": "B3", "max_prompts": 2})))
    assert suite.held_out_dataset == "B3" and suite.origin == "dataset:B3 (B3.jsonl)"
    assert len(suite.prompts) == 2 and suite.n_source_prompts == 28
    for bad, says in (
        ({"dataset": "B9"}, "data_value.suite.dataset 'B9' is not a configured dataset"),
        ({"dataset": "B3", "source": "B3.jsonl"}, "exactly one of `source`"),
        ({}, "exactly one of `source`"),
    ):
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(_config(tmp_path, bad, name="bad.yaml"))
