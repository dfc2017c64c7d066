"""data_value's guards and its files in an object store, without training a draft: dataset keys spelled like
a draft of the report are refused while data_value is configured; suite prompts too long for the target's
context (less the measured output) are quarantined before any training; with an s3:// root the report, its
markdown, the suite's answers and the inputs record are published to the store and read back from it (moto's
S3 server), the store winning over a stale working copy; and the suite's answers, bought once, are in the
store for the next machine."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from eagle3_assets.config import ConfigError, load_config
from eagle3_assets.core.data_value.store import publish, pull, stored_files, value_layout
from eagle3_assets.core.data_value.suite import load_suite, suite_guard
from eagle3_assets.core.data_value.value_report import DataValueReport, SuiteSummary
from eagle3_assets.core.prompts.context import ChatCounter, ContextGuard
from eagle3_assets.core.storage.root_files import root_files

from .support.object_store import BUCKET, s3_options, s3_storage
from .support.projects import make_project, user_rows, write_jsonl

SUITE = {"source": "suite.jsonl", "format": "messages", "max_prompts": 4}


def _project(tmp_path: Path, keys: tuple[str, ...], data_value: dict | None, **top) -> Path:
    datasets = {k: {"rows": user_rows([f"Question {i} of {k}?" for i in range(2)])} for k in keys}
    extra = {"data_value": data_value} if data_value is not None else {}
    return make_project(tmp_path, datasets, **extra, **top)


@pytest.mark.parametrize("key", ["all", "untrained", "all-but-B1", "ALL"])
def test_dataset_keys_spelled_like_a_draft_are_refused_with_data_value(tmp_path, key):
    write_jsonl(tmp_path / "suite.jsonl", user_rows(["A held-out question?"]))
    with pytest.raises(ConfigError, match=re.escape(f"dataset key(s) {key!r} are reserved")):
        load_config(_project(tmp_path, ("B1", key), {"suite": SUITE}))
    # Without data_value the key names only a partition: allowed.
    assert key in load_config(_project(tmp_path, ("B1", key), None)).datasets


def test_suite_prompts_longer_than_the_context_are_quarantined_before_training(tmp_path, chat):
    long = "Explain this sentence word by word. " * 60  # ~420 tokens
    write_jsonl(
        tmp_path / "suite.jsonl",
        [
            {"id": "short", "messages": [{"role": "user", "content": "What is a prime number?"}]},
            {"id": "long", "messages": [{"role": "user", "content": long}]},
            {"id": "also-short", "messages": [{"role": "user", "content": "Name a river in France."}]},
        ],
    )
    cfg = load_config(_project(tmp_path, ("B1",), {"suite": SUITE}))
    # A context of 300 tokens, less 20 measured new tokens: the long prompt does not fit, the others do.
    guard = suite_guard(ContextGuard(300, lambda: ChatCounter(chat), "test"), 20)
    assert guard.context == 280 and "less 20 measured new tokens" in guard.source
    suite = load_suite(cfg, guard)
    assert suite.ids == ["short", "also-short"]
    assert list(suite.quarantined) == ["long"]
    assert "exceeds the target's context of 280 tokens" in suite.quarantined["long"]
    # Without a guard nothing is refused (the guard is what refuses it).
    assert load_suite(cfg).ids == ["short", "long", "also-short"]
    # A suite whose every prompt is refused says so, naming why.
    write_jsonl(tmp_path / "suite.jsonl", [{"id": "long", "messages": [{"role": "user", "content": long}]}])
    with pytest.raises(ValueError, match=r"holds no usable prompt.*long: prompt of"):
        load_suite(cfg, guard)


def _report(n: int) -> DataValueReport:
    return DataValueReport(
        suite=SuiteSummary(n_prompts=n, source="suite.jsonl", prompt_ids=[f"s{i}" for i in range(n)]),
        rows=[],
        floor_acceptance_length=1.0,
        engine="hf",
        draft_tokens=2,
        max_new_tokens=16,
        train_steps=4,
        cost_basis="test",
        seconds={"total": 1.0},
    )


def test_an_object_store_root_holds_the_report_and_wins_over_the_working_copy(tmp_path, s3_server, aws_env):
    from eagle3_assets.assets.data_value import read_value_report
    from eagle3_assets.core.storage.data_version import InputsVersion, record_inputs_version

    write_jsonl(tmp_path / "suite.jsonl", user_rows(["A held-out question?"]))
    storage = s3_storage(s3_server, "dv", tmp_path / "cache")
    cfg = load_config(_project(tmp_path, ("B1",), {"suite": SUITE}, storage=storage))
    assert cfg.storage_is_remote
    layout = value_layout(cfg)
    store = root_files(f"s3://{BUCKET}/dv", s3_options(s3_server), remote=True)
    assert read_value_report(cfg) is None

    # A finished report, written locally as the asset writes it, then published.
    _report(2).write(layout.dir)
    layout.suite_answers.write_text('{"id": "s0"}\n')
    record_inputs_version(layout.dir, InputsVersion.of({"suite": "a"}))
    where = publish(stored_files(cfg), layout)
    assert where[-1] == f"s3://{BUCKET}/dv/data_value/inputs_version.json"  # the record last
    assert json.loads(store.read_text("data_value/report.json") or "{}")["suite"]["n_prompts"] == 2
    assert store.read_text("data_value/suite_answers.jsonl") == '{"id": "s0"}\n'
    assert "| draft |" in (store.read_text("data_value/report.md") or "")

    # A stale working copy (another report, no record): the check and the asset read the store's.
    _report(5).write(layout.dir)
    layout.inputs_version.unlink()
    report = read_value_report(cfg)
    assert report is not None and report.suite.n_prompts == 2
    pull(stored_files(cfg), layout)
    assert json.loads(layout.report_json.read_text())["suite"]["n_prompts"] == 2
    assert layout.inputs_version.exists()

    # A wiped cache is refilled from the store; a local file the store lacks is removed.
    shutil.rmtree(tmp_path / "cache")
    pull(stored_files(cfg), layout)
    assert json.loads(layout.inputs_version.read_text())["parts"] == {"suite": "a"}
    store_empty = load_config(
        _project(tmp_path, ("B1",), {"suite": SUITE}, storage=s3_storage(s3_server, "other", tmp_path / "c2"))
    )
    other = value_layout(store_empty)
    _report(3).write(other.dir)
    pull(stored_files(store_empty), other)
    assert not other.report_json.exists() and not other.report_md.exists()
    assert read_value_report(store_empty) is None


def test_the_suite_is_answered_once_into_the_object_store(tmp_path, s3_server, aws_env, chat):
    """The embedded target answers the suite into `data_value/suite/` in the store; a second machine (a
    wiped working copy) finds the answers there and sends nothing."""
    from eagle3_assets.assets.data_value import answer_the_suite
    from resources import Inference, Storage

    write_jsonl(tmp_path / "suite.jsonl", user_rows(["Name a colour.", "Say hello."]))
    storage_section = s3_storage(s3_server, "answers", tmp_path / "cache")
    cfg = load_config(
        _project(
            tmp_path,
            ("B1",),
            {"suite": SUITE},
            storage=storage_section,
            acceptance={"max_new_tokens": 6, "draft_tokens": 2},
        )
    )
    suite = load_suite(cfg)
    first = answer_the_suite(cfg, suite, Storage(cfg), Inference(cfg), chat, lambda m: None)
    assert first.sent_this_run == 2 and first.backend == "local" and first.greedy
    assert sorted(first.answers) == ["p000", "p001"]
    assert all(a.output_ids and len(a.output_ids) <= 6 for a in first.answers.values())
    store = root_files(f"s3://{BUCKET}/answers", s3_options(s3_server), remote=True)
    assert store.parquet_files("data_value/suite/responses")  # the journal is in the store

    shutil.rmtree(tmp_path / "cache")
    logs: list[str] = []
    again = answer_the_suite(cfg, suite, Storage(cfg), Inference(cfg), chat, logs.append)
    assert again.sent_this_run == 0 and again.bought.answers == 2
    assert {k: a.output_ids for k, a in again.answers.items()} == {
        k: a.output_ids for k, a in first.answers.items()
    }
    assert any("nothing to send" in m for m in logs)


def test_the_demo_extracts_the_value_partitions_and_prints_the_matrix(tmp_path):
    """`make demo` with a data_value section: B1, B3 and B4's states (not the suite's dataset), none without
    the section; the matrix read from the stored report, best first, floor last, flags by name."""
    from eagle3_assets.core.data_value.value_report import DraftRow
    from eagle3_assets.demo import _value_rows, value_keys

    keys = ["B1", "B2", "B3", "B4"]
    write_jsonl(tmp_path / "suite.jsonl", user_rows(["A held-out question?"]))
    with_section = load_config(_project(tmp_path, tuple(keys), {"suite": SUITE}))
    assert value_keys(with_section, keys) == ["B1", "B3", "B4"]
    assert value_keys(load_config(_project(tmp_path, tuple(keys), None)), keys) == []
    held_out = load_config(_project(tmp_path, tuple(keys), {"suite": {"dataset": "B4"}}))
    assert value_keys(held_out, keys) == ["B1", "B3"]

    assert _value_rows(with_section) == []  # no report yet
    report = _report(1)

    def row(draft: str, al: float, usd: float | None, flags: list[str]) -> DraftRow:
        return DraftRow(
            draft=draft,
            datasets=[] if draft == "untrained" else [draft],
            acceptance_length=al,
            per_position=[0.5],
            cost_usd=0.0 if usd is None else 0.01,
            completion_tokens=10,
            gpu_seconds=3.0,
            usd_per_0_1_acceptance=usd,
            flags=flags,
            gain_over_floor=al - 1.0,
            n_train_samples=1,
            answers_bought=1,
            extraction_seconds=1.0,
            training_seconds=2.0,
            measure_seconds=1.0,
        )

    report.rows = [
        row("untrained", 1.0, None, ["floor: the untrained draft"]),
        row("B1", 1.2, None, ["no-cost: nothing paid", "degenerate-loop: 1 of 1 loop"]),
        row("B3", 1.5, 0.002, []),
    ]
    report.write(value_layout(with_section).dir)
    got = _value_rows(with_section)
    assert [r["draft"] for r in got] == ["B3", "B1", "untrained"]
    assert got[0]["$/0.1"] == "0.0020" and got[0]["gain over floor"] == "+0.500" and got[0]["flags"] == "-"
    assert got[1]["$/0.1"] == "-" and got[1]["flags"] == "no-cost, degenerate-loop"
