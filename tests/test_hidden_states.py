"""hidden_states on CPU with the embedded SmolLM2 (L = 30, H = 576): values, layout, resume, fan-out,
exports."""

from __future__ import annotations

import json
import os
import sys

import dagster as dg
import numpy as np
import polars as pl
import pytest
import torch
from safetensors import safe_open

from eagle3_assets.core.hidden_states.exports.export import export
from eagle3_assets.core.hidden_states.extraction import extract_dataset
from eagle3_assets.core.hidden_states.layer_ids import default_aux_layers
from eagle3_assets.core.hidden_states.reader import HiddenStatesReader
from eagle3_assets.core.hidden_states.shards import bytes_per_token

from .support.cli_runs import kill_once_written
from .support.hidden_states import H, L, extraction_settings, reference_states, write_tokens
from .support.projects import make_project, user_rows

PER_TOKEN = bytes_per_token(H, "bfloat16")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_stored_values_equal_an_independent_forward(chat, tmp_path, reference_model):
    layout = write_tokens(chat, tmp_path)
    work, stats, index = extract_dataset(
        layout, extraction_settings(shard_bytes=PER_TOKEN * 120), log=lambda m: None
    )
    assert default_aux_layers(L) == [1, 14, 26]
    assert len(work.todo) >= 3 and stats.padded_tokens == 0 and index.height == 8
    reader = HiddenStatesReader(layout.hidden_states_dir)
    tokens = pl.read_parquet(layout.tokens)
    for sid, ids in zip(tokens["id"].to_list()[:5], tokens["input_ids"].to_list()[:5], strict=True):
        s = reader.sample(sid)
        aux, last, post = reference_states(reference_model, ids)
        assert s["aux_hidden_states"].dtype == torch.bfloat16 and s["aux_hidden_states"].shape == (
            len(ids),
            3 * H,
        )
        assert rel_err(s["aux_hidden_states"], aux) < 1e-2
        assert rel_err(s["last_hidden_state"], last) < 1e-2
        assert rel_err(s["last_hidden_state"], post) > 0.1  # before the final norm, not after
        assert s["input_ids"].tolist() == ids
    meta = safe_open(str(layout.hidden_states_dir / index["shard"][0]), framework="pt").metadata()
    assert json.loads(meta["aux_layers"]) == [1, 14, 26] and meta["last_layer"] == "29"
    assert meta["dtype"] == "bfloat16" and meta["model"] == "builtin:smollm2" and meta["tokenizer"]


def test_layout_and_index_are_consistent_with_tokens(chat, tmp_path):
    layout = write_tokens(chat, tmp_path)
    extract_dataset(layout, extraction_settings(shard_bytes=PER_TOKEN * 100), log=lambda m: None)
    index = pl.read_parquet(layout.hidden_states_dir / "index.parquet")
    tokens = pl.read_parquet(layout.tokens)
    joined = tokens.join(index, on="id")
    assert joined.height == tokens.height == index.height
    assert (joined["n_tokens"] == joined["input_ids"].list.len()).all()
    total = 0
    for shard, group in index.group_by("shard"):
        with safe_open(str(layout.hidden_states_dir / shard[0]), framework="np") as f:
            cu = f.get_tensor("cu_seqlens")
            n = int(cu[-1])
            assert f.get_slice("aux_hidden_states").get_shape() == [n, 3 * H]
            assert f.get_slice("last_hidden_state").get_shape() == [n, H]
            assert f.get_tensor("input_ids").dtype == np.int32 and f.get_tensor("loss_mask").dtype == np.int8
            assert len(cu) == group.height + 1 and sorted(group["position"]) == list(range(group.height))
            total += n
    assert total == int(tokens["input_ids"].list.len().sum())
    size = sum(p.stat().st_size for p in layout.hidden_states_dir.glob("shard-*.safetensors"))
    assert size / total == pytest.approx(
        PER_TOKEN, rel=0.05
    )  # 8·H bytes of bf16 states + ids + mask, no padding


def test_finished_shards_are_kept_and_changed_samples_recomputed(chat, tmp_path):
    layout = write_tokens(chat, tmp_path)
    _work, _, _ = extract_dataset(
        layout, extraction_settings(shard_bytes=PER_TOKEN * 100), log=lambda m: None
    )
    shards = {p.name: p.stat().st_mtime_ns for p in layout.hidden_states_dir.glob("shard-*.safetensors")}
    again, stats, _ = extract_dataset(
        layout, extraction_settings(shard_bytes=PER_TOKEN * 100), log=lambda m: None
    )
    assert again.todo == [] and stats.samples == 0
    assert {
        p.name: p.stat().st_mtime_ns for p in layout.hidden_states_dir.glob("shard-*.safetensors")
    } == shards
    tokens = pl.read_parquet(layout.tokens)  # re-tokenize one sample: only its shard is redone
    changed = tokens["id"][0]
    tokens = tokens.with_columns(
        pl.when(pl.col("id") == changed)
        .then(pl.col("input_ids").list.concat(pl.lit([2], dtype=pl.List(pl.Int32))))
        .otherwise(pl.col("input_ids"))
        .alias("input_ids"),
        pl.when(pl.col("id") == changed)
        .then(pl.col("loss_mask").list.concat(pl.lit([1], dtype=pl.List(pl.Int8))))
        .otherwise(pl.col("loss_mask"))
        .alias("loss_mask"),
    )
    tokens.write_parquet(layout.tokens)
    third, stats, index = extract_dataset(
        layout, extraction_settings(shard_bytes=PER_TOKEN * 100), log=lambda m: None
    )
    assert len(third.stale_shards) == 1 and stats.samples >= 1
    kept = set(shards) - set(third.stale_shards)
    assert kept <= {p.name for p in layout.hidden_states_dir.glob("shard-*.safetensors")}
    assert index.height == tokens.height


KILL_SCRIPT = """
import sys
from pathlib import Path
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.config import HiddenStatesConfig
from eagle3_assets.core.hidden_states.extraction import ExtractionSettings, extract_dataset
extract_dataset(DatasetLayout(Path(sys.argv[1]), "B1"),
                ExtractionSettings(hidden=HiddenStatesConfig(shard_bytes=int(sys.argv[2]))),
                log=lambda m: None)
"""


def test_resume_after_kill_9(chat, tmp_path):
    layout = write_tokens(chat, tmp_path, repeat=6)  # 48 samples, about one shard each
    cmd = [sys.executable, "-c", KILL_SCRIPT, str(tmp_path), str(PER_TOKEN * 40)]
    folder = layout.hidden_states_dir
    kill_once_written(cmd, folder, "shard-*.safetensors", 3, 180)
    before = {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*.safetensors")}
    for name in before:  # every shard that looks finished is complete and readable
        with safe_open(str(folder / name), framework="pt") as f:
            assert f.get_tensor("aux_hidden_states").shape[0] == int(f.get_tensor("cu_seqlens")[-1])
    work, _, index = extract_dataset(
        layout, extraction_settings(shard_bytes=PER_TOKEN * 40), log=lambda m: None
    )
    assert len(work.done_ids) >= len(before)
    after = {p.name: p.stat().st_mtime_ns for p in folder.glob("shard-*.safetensors")}
    assert all(after[n] == t for n, t in before.items())  # never recomputed
    assert index.height == 48 and index["id"].n_unique() == 48


def test_graph_asset_fans_out_one_step_per_shard(chat, tmp_path):
    from eagle3_assets.config import load_config
    from eagle3_assets.definitions import HIDDEN_STATES_JOB, build_definitions

    path = make_project(
        tmp_path,
        {"B1": {"rows": user_rows(["x"])}},
        hidden_states={"shard_bytes": PER_TOKEN * 100, "storage_dtype": "bfloat16"},
    )
    write_tokens(chat, tmp_path / "data")
    defs = build_definitions(load_config(path), str(path))
    with dg.instance_for_test() as instance:
        result = defs.resolve_job_def(HIDDEN_STATES_JOB).execute_in_process(
            partition_key="B1", instance=instance
        )
        assert result.success
        steps = {e.step_key for e in result.all_events if e.event_type_value == "STEP_SUCCESS"}
        shard_steps = [s for s in steps if s.startswith("hidden_states.extract_hidden_state_shard[")]
        md = result.asset_materializations_for_node("hidden_states")[-1].metadata
        assert len(shard_steps) == md["shards"].value >= 3
        assert md["samples"].value == 8 and md["padded_tokens"].value == 0
        events = result.all_events
        observed = [i for i, e in enumerate(events) if e.event_type_value == "ASSET_OBSERVATION"]
        first_extract = min(
            i
            for i, e in enumerate(events)
            if e.event_type_value == "STEP_START" and "extract_hidden" in e.step_key
        )
        assert observed and observed[0] < first_extract  # the plan's bytes are stated before any GPU step
        planned = events[observed[0]].asset_observation_data.asset_observation.metadata
        assert planned["planned_bytes"].value == pytest.approx(md["bytes"].value, rel=0.02)
        assert planned["storage_dtype"].value == md["storage_dtype"].value == "bfloat16"
        again = defs.resolve_job_def(HIDDEN_STATES_JOB).execute_in_process(
            partition_key="B1", instance=instance
        )
        steps = {e.step_key for e in again.all_events if e.event_type_value == "STEP_SUCCESS"}
        assert not [s for s in steps if "extract_hidden_state_shard[" in s]  # nothing left to do


def test_exports_hold_the_stored_states_of_every_sample(chat, tmp_path, reference_model):
    """The values in each layout are the shards' (and the post-norm states are the target's). Whether each
    framework reads, checks and trains on them is for its own code, in its own environment:
    test_trainers_read_exports."""
    import datasets
    from safetensors.torch import load_file

    layout = write_tokens(chat, tmp_path)
    extract_dataset(layout, extraction_settings(shard_bytes=PER_TOKEN * 150), log=lambda m: None)
    reader = HiddenStatesReader(layout.hidden_states_dir)

    # speculators: load_from_disk (saved in torch format, as its loader needs) +
    # hidden_states/hs_{i}.safetensors.
    out = tmp_path / "speculators"
    assert export(layout.hidden_states_dir, out, "speculators", log=lambda m: None) == 8
    ds = datasets.load_from_disk(str(out))
    assert ds.format["type"] == "torch"
    for i in range(len(ds)):
        hs = load_file(str(out / "hidden_states" / f"hs_{i}.safetensors"))
        assert torch.equal(hs["token_ids"], ds[i]["input_ids"])
        assert hs["hidden_states"].shape == (int(ds[i]["seq_len"]), 4, H)
        mine = reader.sample(ds[i]["id"])
        assert torch.equal(hs["hidden_states"][:, :-1].flatten(1), mine["aux_hidden_states"])
        assert torch.equal(hs["hidden_states"][:, -1], mine["last_hidden_state"])
        assert ds[i]["loss_mask"].tolist() == mine["loss_mask"].tolist()

    # SpecForge: os.walk for *.ckpt, torch.load(..., mmap=True), then OfflineEagle3Dataset.process_data's
    # lines.
    out = tmp_path / "specforge"
    export(layout.hidden_states_dir, out, "specforge", log=lambda m: None)
    paths = sorted(
        os.path.join(r, f) for r, _, fs in os.walk(out) for f in fs if f.endswith((".ckpt", ".ckpt.gz"))
    )
    assert len(paths) == 8 and all("/rows_0-2000/" in p for p in paths)
    for p in paths[:3]:
        data = torch.load(p, weights_only=False, mmap=True)
        hidden_state = data["aux_hidden_state"].squeeze(0)[:2048][None, :]
        target = data["hidden_state"].squeeze(0)[:2048][None, :]
        input_ids = data["input_ids"][:2048][None, :]
        loss_mask = data["loss_mask"][:2048][None, :]
        assert hidden_state.shape[:2] == target.shape[:2] == input_ids.shape == loss_mask.shape
        assert hidden_state.shape[-1] == 3 * H and target.shape[-1] == H
        _, _, post = reference_states(reference_model, data["input_ids"].tolist())
        assert rel_err(target[0], post) < 2e-2  # SpecForge wants the last state after the final norm

    # Model-Optimizer: rglob("*.pt"), torch.load(weights_only=True), everything [S, ...].
    out = tmp_path / "modelopt"
    export(layout.hidden_states_dir, out, "modelopt", log=lambda m: None)
    for p in sorted(out.rglob("*.pt"))[:3]:
        d = torch.load(p, weights_only=True)
        assert d["input_ids"].ndim == 1 and d["hidden_states"].shape == (d["input_ids"].shape[0], H)
        assert d["aux_hidden_states"].shape == (d["input_ids"].shape[0], 3 * H)
        assert isinstance(d["conversation_id"], str)


def test_configured_layers_are_output_hidden_states_plus_one_and_exports_say_so(
    chat, tmp_path, reference_model
):
    """aux_layers counts decoder-layer outputs: layer i is output_hidden_states[i + 1]. Each export names the
    ids in its framework's own key and convention."""
    layout = write_tokens(chat, tmp_path, n=3)
    extract_dataset(layout, extraction_settings(aux_layers=[0, 5, 20]), log=lambda m: None)
    reader = HiddenStatesReader(layout.hidden_states_dir)
    tokens = pl.read_parquet(layout.tokens)
    for sid, ids in zip(tokens["id"].to_list(), tokens["input_ids"].to_list(), strict=True):
        with torch.inference_mode():
            hs = reference_model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        aux = reader.sample(sid)["aux_hidden_states"]
        for k, layer in enumerate([0, 5, 20]):
            right = rel_err(aux[:, k * H : (k + 1) * H], hs[layer + 1][0])
            off_by_one = rel_err(aux[:, k * H : (k + 1) * H], hs[layer][0])
            assert right < 1e-2 and right < off_by_one / 2  # clearly index i + 1, not i
    for fmt, ids in (("speculators", [1, 6, 21]), ("specforge", [0, 5, 20]), ("modelopt", [0, 5, 20])):
        out = tmp_path / fmt
        export(layout.hidden_states_dir, out, fmt, log=lambda m: None)
        cfg = json.loads((out / "eagle3_config.json").read_text())
        assert cfg["eagle_aux_hidden_state_layer_ids"] == ids and cfg["num_hidden_layers"] == L, fmt


def test_a_model_whose_attention_ignores_packing_is_extracted_unpacked(
    chat, tmp_path, reference_model, monkeypatch
):
    """Simulated by taking away the packed-sequence detection transformers' masks rely on: a packed forward
    then lets samples attend to each other. The self-test at load sees it and extraction falls back to one
    sample per forward, whose values are right."""
    import transformers.masking_utils as masking

    from eagle3_assets.core.hidden_states import extraction

    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    monkeypatch.setattr(extraction, "_PACKING", {})  # the verdict is cached per loaded model
    logs: list[str] = []
    layout = write_tokens(chat, tmp_path, n=4)
    extract_dataset(layout, extraction_settings(), log=logs.append)
    assert any("ignores packed sample boundaries" in m for m in logs)
    index = pl.read_parquet(layout.hidden_states_dir / "index.parquet")
    meta = safe_open(str(layout.hidden_states_dir / index["shard"][0]), framework="pt").metadata()
    assert meta["packing"].startswith("one sample per forward")
    reader = HiddenStatesReader(layout.hidden_states_dir)
    tokens = pl.read_parquet(layout.tokens)
    for sid, ids in zip(tokens["id"].to_list(), tokens["input_ids"].to_list(), strict=True):
        aux, _last, _ = reference_states(reference_model, ids)
        assert rel_err(reader.sample(sid)["aux_hidden_states"], aux) < 1e-2


def test_packing_is_used_where_the_model_respects_it(chat, tmp_path, monkeypatch):
    from eagle3_assets.core.hidden_states import extraction

    monkeypatch.setattr(extraction, "_PACKING", {})
    layout = write_tokens(chat, tmp_path, n=4)
    logs: list[str] = []
    extract_dataset(layout, extraction_settings(), log=logs.append)
    index = pl.read_parquet(layout.hidden_states_dir / "index.parquet")
    meta = safe_open(str(layout.hidden_states_dir / index["shard"][0]), framework="pt").metadata()
    assert meta["packing"] == "packed" and not any("ignores packed" in m for m in logs)
