"""The acceptance gate is data-versioned by what it reads: with nothing changed a rerun re-reports the stored
report (no training, no measurement: the draft's checkpoint is not rewritten and no training step is logged),
and a change to any input (states, prompts, answers, target identity, settings, template, code) reruns it.

The first tests version a synthetic partition (seconds); the last runs the real gate through Dagster on the
embedded target: a run that trains, a no-op rerun, and a rerun after a setting changed."""

from __future__ import annotations

import ast
import json
import shutil
import time

import dagster as dg
import polars as pl
import pytest
import torch
from safetensors.torch import save_file

from eagle3_assets.config import load_config
from eagle3_assets.core.acceptance.gate_report import GateReport
from eagle3_assets.core.acceptance.gate_version import (
    GATE_CODE_VERSION,
    GATE_SOURCES,
    gate_inputs_version,
    stored_gate,
    versioned_gate,
)
from eagle3_assets.core.storage.data_version import recorded_inputs_version
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.definitions import ACCEPTANCE_JOB, HIDDEN_STATES_JOB, TRAINING_DATA_JOB, build_definitions

from .support.projects import REPO


def _shard(path, ids: list[int], layers: str = "[2, 15, 27]") -> None:
    save_file(
        {"input_ids": torch.tensor(ids, dtype=torch.int32), "aux_hidden_states": torch.zeros(len(ids), 6)},
        str(path),
        metadata={"layers": layers},
    )


@pytest.fixture
def partition(tmp_path):
    """A partition with every file the gate reads, a config, and a version recorded for it."""
    datasets = {"B1": {"source": "B1.jsonl", "format": "instruction"}}
    (tmp_path / "eagle3.yaml").write_text(json.dumps({"storage": {"root": "data"}, "datasets": datasets}))
    cfg = load_config(tmp_path / "eagle3.yaml")
    layout = DatasetLayout(tmp_path / "data", "B1").ensure()
    layout.hidden_states_dir.mkdir()
    _shard(layout.hidden_states_dir / "shard-a.safetensors", [1, 2, 3])
    pl.DataFrame({"id": ["a"], "shard": ["shard-a.safetensors"]}).write_parquet(layout.hidden_states_index)
    pl.DataFrame({"id": ["a"], "messages": ["hi"]}).write_parquet(layout.prompts)
    layout.responses_dir.mkdir()
    pl.DataFrame({"id": ["a"], "content": ["hello"]}).write_parquet(layout.responses_dir / "data-1.parquet")
    layout.target_identity.write_text(json.dumps({"model": "m"}))
    return layout, cfg


def test_each_kind_of_input_change_moves_the_version(partition) -> None:
    layout, cfg = partition
    base = gate_inputs_version(layout, cfg, "template-1")
    assert gate_inputs_version(layout, cfg, "template-1") == base  # deterministic

    def changed(**kw) -> list[str]:
        return gate_inputs_version(
            layout,
            kw.get("cfg", cfg),
            kw.get("template", "template-1"),
            **({"code": kw["code"]} if "code" in kw else {}),
        ).changed(base)

    # Rewriting the same bytes (an index rebuilt, a copy pulled afresh) changes nothing.
    index = layout.hidden_states_index.read_bytes()
    layout.hidden_states_index.write_bytes(index)
    # Nor does the extraction plan, which every extraction run rewrites with its own timestamp.
    layout.extraction_plan.write_text(json.dumps({"created_at": time.time()}))
    assert changed() == []
    assert changed(template="template-2") == ["template"]
    assert changed(code=GATE_CODE_VERSION + "-edited") == ["code"]
    other = cfg.model_copy(update={"acceptance": cfg.acceptance.model_copy(update={"train_steps": 7})})
    assert changed(cfg=other) == ["settings"]
    other = cfg.model_copy(update={"target": cfg.target.model_copy(update={"revision": "abc"})})
    assert changed(cfg=other) == ["settings"]

    steps = [
        ("shard rewritten", lambda: _shard(layout.hidden_states_dir / "shard-a.safetensors", [1, 2, 4])),
        ("shard added", lambda: _shard(layout.hidden_states_dir / "shard-b.safetensors", [5])),
        ("prompts", lambda: pl.DataFrame({"id": ["a"], "messages": ["yo"]}).write_parquet(layout.prompts)),
        (
            "answers",
            lambda: pl.DataFrame({"id": ["b"], "content": ["x"]}).write_parquet(
                layout.responses_dir / "part-2.parquet"
            ),
        ),
        ("target", lambda: layout.target_identity.write_text(json.dumps({"model": "other"}))),
    ]
    expected = ["hidden_states", "hidden_states", "prompts", "responses", "target_identity"]
    for (what, change), part in zip(steps, expected, strict=True):
        before = gate_inputs_version(layout, cfg, "template-1")
        change()
        after = gate_inputs_version(layout, cfg, "template-1")
        assert after.changed(before) == [part], what


def _report() -> GateReport:
    part = {
        "acceptance_length": 2.0,
        "per_position": [0.5, 0.5],
        "n_prompts": 1,
        "n_steps": 3,
        "new_tokens": 6,
    }
    reading = {"config": "c", "eagle_aux_hidden_state_layer_ids": [1], "how": "h"}
    return GateReport.model_validate(
        {
            "draft_tokens": 2,
            "engine": "transformers",
            "max_new_tokens": 8,
            "train": part,
            "heldout": part,
            "untrained": part,
            "source_answers": {"skipped": "off"},
            "greedy_check": {"prompts": 1, "equal": 1, "differences": {}},
            "training": {
                "optimizer_steps": 1,
                "ttt_steps": 2,
                "samples": 1,
                "tokens_seen": 3,
                "first_loss": 1.0,
                "final_loss": 0.5,
                "final_step_accuracy": [0.5, 0.5],
                "draft_vocab_size": 8,
            },
            "boundaries": {"checked": 1, "bad": 0, "examples": {}},
            "draft": {
                "path": "draft",
                "layout": "l",
                "eagle_aux_hidden_state_layer_ids": [2],
                "layer_ids_convention": "c",
                "sglang": reading,
            },
            "feature_ids_output_hidden_states": [2],
            "heldout_ids": ["a"],
            "device": "cpu",
            "seconds": {"total": 1.0},
            "gate": {"passed": True, "reasons": [], "min_train_acceptance_length": 2.4},
        }
    )


def test_the_code_version_covers_every_core_module_the_gate_imports() -> None:
    """An edit to code the gate runs must rerun it: every module of the core that the acceptance package
    imports is under GATE_SOURCES (a module left out would keep a stale verdict after its edit). The storage
    package is the one exception: it says where files lie and versions them, it computes nothing reported."""
    core = REPO / "eagle3_assets" / "core"
    package = core / "acceptance"
    covered = {f for p in GATE_SOURCES for f in (p.rglob("*.py") if p.is_dir() else [p])}
    missing = set()
    for source in package.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module:
                if node.module.startswith("storage."):
                    continue
                target = core.joinpath(*node.module.split("."))
                module = (
                    target.with_suffix(".py")
                    if target.with_suffix(".py").exists()
                    else target / "__init__.py"
                )
                if module.resolve() not in {c.resolve() for c in covered}:
                    missing.add(f"{source.name} imports {node.module}")
    assert not missing, sorted(missing)


def test_the_stored_report_is_reused_only_for_the_same_inputs(partition) -> None:
    layout, cfg = partition
    inputs = gate_inputs_version(layout, cfg, "t")
    runs: list[str] = []

    def gate() -> GateReport:  # stands in for run_gate: writes what it writes, counted
        runs.append("ran")
        _report().write(layout)
        layout.draft_dir.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            (layout.draft_dir / name).write_text(str(len(runs)))
        return _report()

    assert stored_gate(layout, inputs) is None  # nothing stored
    first = versioned_gate(layout, inputs, gate)
    assert not first.reused and not first.had_record and first.changed == sorted(inputs.parts)
    assert len(runs) == 1
    again = versioned_gate(layout, inputs, gate)
    assert (
        again.reused and again.report == first.report and again.recorded == first.recorded and len(runs) == 1
    )
    # The draft gone, or the report: the record alone is not a stored gate.
    (layout.draft_dir / "model.safetensors").unlink()
    assert stored_gate(layout, inputs) is None
    rerun = versioned_gate(layout, inputs, gate)
    assert not rerun.reused and rerun.had_record and rerun.changed == [] and len(runs) == 2
    layout.acceptance_report.unlink()
    assert stored_gate(layout, inputs) is None
    # A gate that dies halfway leaves no record: the next run computes again.
    other = gate_inputs_version(layout, cfg, "t2")

    def dies() -> GateReport:
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        versioned_gate(layout, other, dies)
    assert recorded_inputs_version(layout.acceptance_dir) is None
    assert stored_gate(layout, inputs) is None
    changed = versioned_gate(layout, other, gate)
    assert not changed.reused and not changed.had_record  # no record to compare with


# -- the real gate through Dagster ---------------------------------------------------------------------------
# Tiny: the verdict does not matter here, only whether the gate trains.
GATE = {
    "train_prompts": 4,
    "heldout_prompts": 2,
    "max_new_tokens": 8,
    "train_steps": 8,
    "compare_source_answers": False,
}


def _project(root, gate: dict):
    path = root / "eagle3.yaml"
    path.write_text(
        json.dumps(
            {
                "storage": {"root": "data"},
                "datasets": {"B3": {"source": "B3.jsonl", "format": "instruction", "max_tokens": 24}},
                "acceptance": gate,
            }
        )
    )
    return build_definitions(load_config(path), str(path))


def _gate_run(defs, instance):
    t0 = time.perf_counter()
    result = defs.resolve_job_def(ACCEPTANCE_JOB).execute_in_process(
        partition_key="B3", instance=instance, raise_on_error=False
    )
    seconds = time.perf_counter() - t0
    md = result.asset_materializations_for_node("acceptance")[-1].metadata
    logs = [e.user_message for e in instance.all_logs(result.run_id)]
    return md, logs, seconds


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two gates and a no-op on 2 busy cores
def test_a_rerun_with_nothing_changed_does_not_train(tmp_path) -> None:
    shutil.copy(REPO / "prompts" / "B3.jsonl", tmp_path / "B3.jsonl")
    defs = _project(tmp_path, GATE)
    layout = DatasetLayout(tmp_path / "data", "B3")
    checkpoint = layout.draft_dir / "model.safetensors"
    with dg.instance_for_test() as instance:
        for job, run_config in (
            (TRAINING_DATA_JOB, {"ops": {"responses": {"config": {"limit": 8}}}}),
            (HIDDEN_STATES_JOB, None),
        ):
            result = defs.resolve_job_def(job).execute_in_process(
                partition_key="B3", instance=instance, run_config=run_config, raise_on_error=False
            )
            assert result.success, (job, [e.message for e in result.all_events if e.is_failure])

        first, logs, trained_s = _gate_run(defs, instance)
        assert any("draft training step" in m for m in logs)
        assert first["status"].value.startswith("computed at")
        stamp = checkpoint.stat().st_mtime_ns
        report = json.loads(layout.acceptance_report.read_text())
        # Point 5: the acceptance length the heldout step accuracy implies, beside the served one.
        k = report["draft_tokens"]
        sim = report["simulated"]
        assert 0 < sim["acceptance_length"] <= k + 1 and len(sim["per_position"]) == k
        assert sim["served_acceptance_length"] == report["heldout"]["acceptance_length"]
        assert 0 < report["training"]["simulated_acceptance_length"] <= k + 1
        assert first["simulated_acceptance_length"].value == sim["acceptance_length"]
        assert first["served_over_simulated"].value == sim["served_over_simulated"]

        # Nothing changed: the stored report, re-reported; nothing trained, the draft not rewritten.
        again, logs, noop_s = _gate_run(defs, instance)
        assert not any("draft training step" in m for m in logs)
        assert checkpoint.stat().st_mtime_ns == stamp
        assert again["status"].value.startswith("unchanged since")
        assert again["inputs_version"].value == first["inputs_version"].value
        for name in ("heldout_acceptance_length", "train_acceptance_length", "simulated_acceptance_length"):
            assert again[name].value == first[name].value
        assert json.loads(layout.acceptance_report.read_text()) == report
        print(f"gate: trained and measured in {trained_s:.1f} s; no-op rerun {noop_s:.1f} s")

        # A setting changed: it trains again.
        changed = _project(tmp_path, {**GATE, "train_steps": 9})
        third, logs, _ = _gate_run(changed, instance)
        assert any("draft training step" in m for m in logs)
        assert checkpoint.stat().st_mtime_ns != stamp
        assert third["status"].value.endswith("(changed: settings)")
        assert third["inputs_version"].value != first["inputs_version"].value
