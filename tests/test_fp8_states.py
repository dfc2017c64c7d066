"""FP8 hidden-state storage (`hidden_states.storage_dtype: float8_e4m3fn`) on CPU with the embedded SmolLM2:
the shards' layout and bytes, values as close to an fp32 forward as FP8 allows (measured against a plain
per-token per-layer rounding of that forward), the checks on dequantized values, wrong scales and misplaced
states failing, and the plan's size stated and refused before any forward when the disk is too small."""

from __future__ import annotations

import itertools
import json
import os
import subprocess

import polars as pl
import pytest
import torch
from pydantic import ValidationError
from safetensors import safe_open

from eagle3_assets.config import HiddenStatesConfig
from eagle3_assets.core.hidden_states import checks
from eagle3_assets.core.hidden_states.extraction import expected_metadata, extract_dataset, prepare
from eagle3_assets.core.hidden_states.reader import HiddenStatesReader
from eagle3_assets.core.hidden_states.shards import bytes_per_token, finished_shards
from eagle3_assets.core.hidden_states.sizing import NotEnoughSpace

from .support.hidden_states import (
    H,
    extraction_settings,
    reference_states,
    rewrite_every_shard,
    rewrite_shard,
    verdicts,
    write_tokens,
)

FP8 = "float8_e4m3fn"
QUIET = {"log": lambda m: None}


def reference_rounding(x: torch.Tensor, n: int) -> torch.Tensor:
    """A straightforward per-token, per-layer FP8 rounding, written here apart from the project's code: each
    (token, layer) block divided by its absmax / 448, cast to e4m3, cast back and multiplied again."""
    blocks = x.float().reshape(x.shape[0], n, -1)
    scale = blocks.abs().amax(-1, keepdim=True) / torch.finfo(torch.float8_e4m3fn).max
    return ((blocks / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)


def block_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


@pytest.fixture
def fp8_extracted(chat, tmp_path):
    layout = write_tokens(chat, tmp_path, n=6)
    s = extraction_settings(storage_dtype=FP8)
    extract_dataset(layout, s, **QUIET)
    return layout, s


def test_fp8_shards_are_a_per_token_per_layer_rounding_of_an_fp32_forward(chat, tmp_path, reference_model):
    layout = write_tokens(chat, tmp_path)
    _, stats, index = extract_dataset(
        layout, extraction_settings(storage_dtype=FP8, shard_bytes=60_000), **QUIET
    )
    assert index.height == 8 and len(stats.shards) >= 2
    assert set(index["storage_dtype"]) == {FP8}  # the index names the storage dtype too
    for name in finished_shards(layout.hidden_states_dir):
        with safe_open(str(layout.hidden_states_dir / name), framework="pt") as f:
            meta, n = f.metadata(), int(f.get_tensor("cu_seqlens")[-1])
            assert meta["dtype"] == FP8 and "scales" in meta
            assert f.get_slice("aux_hidden_states").get_dtype() == "F8_E4M3"
            assert f.get_slice("last_hidden_state").get_dtype() == "F8_E4M3"
            assert f.get_slice("aux_hidden_states_scales").get_shape() == [n, 3]
            assert f.get_slice("last_hidden_state_scales").get_shape() == [n, 1]
            assert f.get_slice("aux_hidden_states_scales").get_dtype() == "F32"
    reader = HiddenStatesReader(layout.hidden_states_dir)
    tokens = pl.read_parquet(layout.tokens)
    measured = []
    for sid, ids in zip(tokens["id"].to_list(), tokens["input_ids"].to_list(), strict=True):
        s = reader.sample(sid)
        raw = reader.sample(sid, raw=True)
        assert s["aux_hidden_states"].dtype == torch.float32  # read dequantized, as the contract says
        want = (
            raw["aux_hidden_states"].float().view(len(ids), 3, -1)
            * raw["aux_hidden_states_scales"][..., None]
        )
        assert torch.equal(s["aux_hidden_states"], want.view(len(ids), -1))
        aux, last, _ = reference_states(reference_model, ids)
        ref_aux, ref_last = reference_rounding(aux, 3), reference_rounding(last, 1)
        for k in range(3):
            cols = slice(k * H, (k + 1) * H)
            stored, ref = (
                block_err(s["aux_hidden_states"][:, cols], aux[:, cols]),
                block_err(ref_aux[:, cols], aux[:, cols]),
            )
            measured.append((stored, ref))
        measured.append((block_err(s["last_hidden_state"], last), block_err(ref_last, last)))
    for stored, ref in measured:
        assert ref > 1e-3  # FP8's rounding, not bf16's (the comparison means something)
        assert stored <= ref * 1.02 + 1e-5, (stored, ref)
    print(
        "FP8 relative error, stored vs reference rounding:",
        [(round(a, 5), round(b, 5)) for a, b in measured[:4]],
    )


def test_fp8_shards_take_about_half_the_bytes_of_bf16(chat, tmp_path):
    sizes = {}
    for dtype in ("bfloat16", FP8):
        layout = write_tokens(chat, tmp_path / dtype)
        work, stats, _ = extract_dataset(layout, extraction_settings(storage_dtype=dtype), **QUIET)
        folder = layout.hidden_states_dir
        written = sum(p.stat().st_size for p in folder.glob("shard-*.safetensors"))
        assert written == pytest.approx(work.planned["planned_bytes"], rel=0.02)  # the plan said so before
        sizes[dtype] = written / stats.tokens
    ratio = sizes[FP8] / sizes["bfloat16"]
    print(f"bytes per token: bf16 {sizes['bfloat16']:.0f}, fp8 {sizes[FP8]:.0f}, ratio {ratio:.3f}")
    assert 0.5 <= ratio <= 0.55
    # per token: 4 layers x H bytes + 4 float32 scales + int32 id + int8 mask
    assert bytes_per_token(H, FP8) == 4 * H + 16 + 5 and sizes[FP8] == pytest.approx(4 * H + 21, rel=0.02)


def test_checks_pass_on_fp8_states_read_dequantized(fp8_extracted, reference_model):
    layout, s = fp8_extracted
    assert verdicts(layout, s) == dict.fromkeys(
        ["coverage", "ids_match", "finite", "consistent", "spot_check"], True
    )
    index = pl.read_parquet(layout.hidden_states_dir / "index.parquet")
    v = checks.spot_check(layout.hidden_states_dir, reference_model, checks.spot_sample_ids(index, 6))
    rule = json.loads(v.metadata["rule"])
    assert rule == {
        "float32 -> float8_e4m3fn": {
            "every_token": 0.998,
            "median_token": 0.999,
            "norm_deviation_every_token": 0.0625,
            "norm_deviation_median_token": 0.02,
        }
    }
    print("FP8 spot check:", {k: v.metadata[k] for k in v.metadata if "cosine" in k or "norm" in k})
    assert v.metadata["min_token_cosine"] < 0.9999  # FP8's rounding shows, and still passes
    assert checks.finite(layout.hidden_states_dir).metadata["bad_scales"] == 0


@pytest.mark.parametrize("wrong", ["zero", "inf", "nan"])
def test_a_scale_no_quantization_writes_fails_finite(fp8_extracted, wrong):
    layout, s = fp8_extracted
    value = {"zero": 0.0, "inf": float("inf"), "nan": float("nan")}[wrong]

    def poison(t, _meta):
        t["aux_hidden_states_scales"][3, 1] = value

    rewrite_shard(layout.hidden_states_dir, poison)
    v = verdicts(layout, s)
    assert v["finite"] is False and v["consistent"] and v["ids_match"]
    assert checks.finite(layout.hidden_states_dir).metadata["bad_scales"] == 1


@pytest.mark.parametrize(
    "how", ["shifted_by_a_row", "first_two_tokens_swapped", "last_layer_mid_tokens_swapped"]
)
def test_scales_swapped_between_tokens_fail_the_spot_check(fp8_extracted, how):
    """Wrong per-token scales leave every value finite, every shape right and every cosine intact: only the
    norm rule of the spot check sees them (for the last layer, against the last decoder layer's own output:
    through the final norm a token's scale is gone)."""
    layout, s = fp8_extracted

    def swap(t, _meta):
        bounds = t["cu_seqlens"].tolist()
        if how == "last_layer_mid_tokens_swapped":
            for a, b in itertools.pairwise(bounds):
                c = (a + b) // 2
                t["last_hidden_state_scales"][[c, c + 1]] = t["last_hidden_state_scales"][[c + 1, c]]
            return
        for key in ("aux_hidden_states_scales", "last_hidden_state_scales"):
            if how == "shifted_by_a_row":
                t[key] = torch.roll(t[key], 1, dims=0).contiguous()
            else:
                for a in bounds[:-1]:
                    t[key][[a, a + 1]] = t[key][[a + 1, a]]

    rewrite_every_shard(layout.hidden_states_dir, swap)
    v = verdicts(layout, s)
    assert v["spot_check"] is False and v["finite"] and v["consistent"] and v["ids_match"]


def test_fp8_states_shifted_by_a_position_fail_the_spot_check(fp8_extracted):
    layout, s = fp8_extracted

    def shift(t, _meta):  # values and their scales moved together: a writer off by one row
        for key in (
            "aux_hidden_states",
            "last_hidden_state",
            "aux_hidden_states_scales",
            "last_hidden_state_scales",
        ):
            t[key] = torch.roll(t[key], 1, dims=0).contiguous()

    rewrite_every_shard(layout.hidden_states_dir, shift)
    v = verdicts(layout, s)
    assert v["spot_check"] is False and v["finite"] and v["consistent"]


def test_fp8_states_off_by_a_layer_fail_the_spot_check(chat, tmp_path):
    """Layers [2, 15, 27] stored under the name [1, 14, 26]: consistent on paper, wrong against the
    forward."""
    layout = write_tokens(chat, tmp_path, n=6)
    s = extraction_settings(storage_dtype=FP8)
    extract_dataset(layout, extraction_settings(storage_dtype=FP8, aux_layers=[2, 15, 27]), **QUIET)

    def relabel(_t, meta):
        meta["aux_layers"] = json.dumps([1, 14, 26])

    rewrite_every_shard(layout.hidden_states_dir, relabel)
    v = verdicts(layout, s)
    assert v["spot_check"] is False and v["consistent"] and v["finite"]


def test_changing_storage_dtype_recomputes_the_shards(chat, tmp_path):
    layout = write_tokens(chat, tmp_path)
    extract_dataset(layout, extraction_settings(), **QUIET)
    bf16 = set(finished_shards(layout.hidden_states_dir))
    work, stats, index = extract_dataset(layout, extraction_settings(storage_dtype=FP8), **QUIET)
    assert set(work.stale_shards) == bf16 and stats.samples == 8 and index.height == 8
    metas = finished_shards(layout.hidden_states_dir)
    assert {m["dtype"] for m in metas.values()} == {FP8}
    assert checks.consistent(
        layout.hidden_states_dir, expected_metadata(extraction_settings(storage_dtype=FP8))
    ).passed
    again, stats, _ = extract_dataset(layout, extraction_settings(storage_dtype=FP8), **QUIET)
    assert (
        again.todo == [] and again.stale_shards == [] and stats.samples == 0
    )  # and unchanged, nothing redone


def test_the_plan_states_its_bytes_and_refuses_a_disk_too_small(chat, tmp_path, monkeypatch):
    import shutil

    from eagle3_assets.core.hidden_states import sizing

    layout = write_tokens(chat, tmp_path)
    tokens = int(pl.read_parquet(layout.tokens)["input_ids"].list.len().sum())
    real = shutil.disk_usage
    monkeypatch.setattr(sizing.shutil, "disk_usage", lambda p: real(p)._replace(free=1_000_000))
    with pytest.raises(NotEnoughSpace) as e:
        prepare(layout, extraction_settings(), **QUIET)
    planned = tokens * bytes_per_token(H, "bfloat16")
    message = str(e.value)
    assert (
        f"{planned / 1e6:,.2f} MB" in message
        and "1.00 MB free" in message
        and "storage_dtype bfloat16" in message
    )
    assert not list(layout.hidden_states_dir.glob("shard-*"))
    work = prepare(layout, extraction_settings(storage_dtype=FP8), **QUIET)  # half the bytes fit
    assert work.planned["planned_bytes"] == tokens * bytes_per_token(H, FP8) < 1_000_000
    plan = json.loads(layout.extraction_plan.read_text())
    assert (
        plan["planned"]["planned_bytes"] == work.planned["planned_bytes"]
        and plan["planned"]["storage_dtype"] == FP8
    )
    assert (
        prepare(layout, extraction_settings(), check_space=False, **QUIET).planned["planned_bytes"] == planned
    )


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip()})")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_real_small_disk_refuses_bf16_and_takes_fp8(chat, small_disk):
    """1 MB of tmpfs: the partition's 1.6 MB of bf16 shards are refused before any forward, its 0.8 MB of FP8
    shards are extracted."""
    layout = write_tokens(chat, small_disk)
    with pytest.raises(NotEnoughSpace, match="storage_dtype bfloat16"):
        extract_dataset(layout, extraction_settings(), **QUIET)
    assert not list(layout.hidden_states_dir.glob("shard-*"))
    _, stats, index = extract_dataset(layout, extraction_settings(storage_dtype=FP8), **QUIET)
    assert index.height == 8 and stats.samples == 8


def test_storage_dtype_config():
    assert HiddenStatesConfig().storage_dtype == "bfloat16"
    assert HiddenStatesConfig(storage_dtype=FP8).storage_dtype == FP8
    assert HiddenStatesConfig(dtype="auto").storage_dtype == "bfloat16"  # the key's earlier name
    assert HiddenStatesConfig(dtype="float32").storage_dtype == "float32"
    with pytest.raises(ValidationError, match="disagree"):
        HiddenStatesConfig(dtype="float32", storage_dtype=FP8)
    with pytest.raises(ValidationError):
        HiddenStatesConfig(storage_dtype="float8_e5m2")


def test_served_states_are_quantized_as_they_land(tmp_path):
    """The vLLM path's shard buffer: each sample's states [t, 4, H] (the server's dtype) quantized into the
    shard's rows as it lands; a sample refused as too long leaves the shard with its scales compacted
    alike."""
    import numpy as np

    from eagle3_assets.core.hidden_states.served import ShardBuffer, _write
    from eagle3_assets.core.hidden_states.shards import Sample, ShardPlan, write_index

    rng = np.random.default_rng(0)
    samples = {
        f"s{i}": Sample(f"s{i}", np.arange(n, dtype=np.int32), np.ones(n, dtype=np.int8))
        for i, n in enumerate((5, 3, 7))
    }
    plan = ShardPlan("shard-x.safetensors", tuple(samples), 15)
    states = {
        sid: torch.from_numpy(rng.standard_normal((len(s.input_ids), 4, 32)).astype(np.float32))
        for sid, s in samples.items()
    }
    states["s0"][0] *= 1000  # a token of massive activations: its own scale, the others keep their precision
    buf = ShardBuffer(plan, samples)
    for sid in ("s2", "s0"):  # in any order; s1 never arrives (refused as too long)
        buf.put(sid, states[sid], 3, FP8)
        buf.arrived.add(sid)
    meta = {"dtype": FP8, "aux_layers": "[1, 2, 3]", "hidden_size": "32"}
    _write(tmp_path / plan.name, [samples["s0"], samples["s2"]], buf, meta)
    write_index(tmp_path)
    reader = HiddenStatesReader(tmp_path)
    for sid in ("s0", "s2"):
        got, raw = reader.sample(sid), reader.sample(sid, raw=True)
        assert (
            raw["aux_hidden_states"].dtype == torch.float8_e4m3fn
            and raw["last_hidden_state_scales"].shape[1] == 1
        )
        x = states[sid]
        assert torch.equal(got["aux_hidden_states"], reference_rounding(x[:, :3].reshape(len(x), -1), 3))
        assert torch.equal(got["last_hidden_state"], reference_rounding(x[:, 3], 1))
    assert sorted(reader.ids()) == ["s0", "s2"]


def test_exports_of_fp8_shards(fp8_extracted):
    """speculators keeps FP8 (`hidden_states` float8 [S, 4, H] + `hidden_states_scales` [S, 4, 1],
    hs-connectors' layout); SpecForge and Model-Optimizer read no FP8 and get the dequantized states in bf16;
    each manifest says which. (Each framework reading them with its own code: test_trainers_read_exports, in
    side environments.)"""
    import datasets
    from safetensors.torch import load_file

    from eagle3_assets.core.hidden_states.exports.export import export

    layout, _ = fp8_extracted
    folder = layout.hidden_states_dir
    reader = HiddenStatesReader(folder)
    out = folder.parent / "exports"

    export(folder, out / "speculators", "speculators", **QUIET)
    manifest = json.loads((out / "speculators" / "manifest.json").read_text())
    assert manifest["dtype"] == FP8 and manifest["dequantized"] is False
    assert manifest["train_command"].endswith("--hidden-states-backend fp8")
    ds = datasets.load_from_disk(str(out / "speculators"))
    for i in range(len(ds)):
        hs = load_file(str(out / "speculators" / "hidden_states" / f"hs_{i}.safetensors"))
        t = int(ds[i]["seq_len"])
        assert hs["hidden_states"].dtype == torch.float8_e4m3fn and hs["hidden_states"].shape == (t, 4, H)
        assert hs["hidden_states_scales"].dtype == torch.float32 and hs["hidden_states_scales"].shape == (
            t,
            4,
            1,
        )
        read = (hs["hidden_states"].float() * hs["hidden_states_scales"]).to(
            torch.bfloat16
        )  # FP8Transfer's reading
        mine = reader.sample(ds[i]["id"])
        assert torch.equal(read[:, :3].flatten(1), mine["aux_hidden_states"].to(torch.bfloat16))
        assert torch.equal(read[:, 3], mine["last_hidden_state"].to(torch.bfloat16))

    for fmt, key in (("specforge", "aux_hidden_state"), ("modelopt", "aux_hidden_states")):
        export(folder, out / fmt, fmt, **QUIET)
        manifest = json.loads((out / fmt / "manifest.json").read_text())
        assert (
            manifest["dtype"] == "bfloat16"
            and manifest["source_dtype"] == FP8
            and manifest["dequantized"] is True
        )
        files = sorted((out / fmt).rglob("*.ckpt" if fmt == "specforge" else "*.pt"))
        assert len(files) == len(reader)
        for p in files[:3]:
            d = torch.load(p, weights_only=fmt == "modelopt")
            sid = d.get("conversation_id") or next(
                i for i in reader.ids() if reader.sample(i)["input_ids"].tolist() == d["input_ids"].tolist()
            )
            aux = d[key].reshape(-1, 3 * H)
            assert aux.dtype == torch.bfloat16
            assert torch.equal(aux, reader.sample(sid)["aux_hidden_states"].to(torch.bfloat16))


def test_half_precision_compute_stored_in_fp8_passes_its_rule_and_a_layer_off_still_fails(
    chat, tmp_path, reference_model, monkeypatch
):
    """States computed in bf16 (as on a GPU or a bf16 server), stored in FP8: two roundings, held to the
    looser every-token bars of half precision (cosine 0.99, norm 2^-3), which layers off by one still fail."""
    import copy

    from eagle3_assets.core.hidden_states import extraction

    bf16 = copy.deepcopy(reference_model).to(torch.bfloat16)
    monkeypatch.setattr(extraction, "load_target_model", lambda _settings: bf16)
    folders = {}
    for tag, aux in (("right", None), ("layer_off", [2, 15, 27])):
        layout = write_tokens(chat, tmp_path / tag, n=6)
        extract_dataset(layout, extraction_settings(storage_dtype=FP8, aux_layers=aux), **QUIET)
        if aux:
            rewrite_every_shard(
                layout.hidden_states_dir,
                lambda _t, meta: meta.__setitem__("aux_layers", json.dumps([1, 14, 26])),
            )
        folders[tag] = layout.hidden_states_dir
    results = {}
    for tag, folder in folders.items():
        index = pl.read_parquet(folder / "index.parquet")
        results[tag] = checks.spot_check(folder, reference_model, checks.spot_sample_ids(index, 6))
    right = results["right"].metadata
    assert right["compute_dtype"] == "bfloat16" and "bfloat16 -> float8_e4m3fn" in right["rule"]
    print("bf16 compute, FP8 storage:", {k: right[k] for k in right if "cosine" in k or "norm" in k})
    assert (
        results["right"].passed and right["min_token_cosine"] < 0.999
    )  # the looser bar is needed, and enough
    assert results["layer_off"].passed is False


def test_through_dagster_fp8_shards_pass_every_check_and_say_their_dtype(chat, tmp_path):
    import dagster as dg

    from eagle3_assets.config import load_config
    from eagle3_assets.definitions import HIDDEN_STATES_JOB, build_definitions

    from .support.projects import make_project, user_rows

    path = make_project(tmp_path, {"B1": {"rows": user_rows(["x"])}}, hidden_states={"storage_dtype": FP8})
    write_tokens(chat, tmp_path / "data")
    defs = build_definitions(load_config(path), str(path))
    with dg.instance_for_test() as instance:
        result = defs.resolve_job_def(HIDDEN_STATES_JOB).execute_in_process(
            partition_key="B1", instance=instance, raise_on_error=False
        )
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    evaluations = {e.check_name: e for e in result.get_asset_check_evaluations()}
    assert {"hidden_states_finite", "hidden_states_consistent", "hidden_states_spot_check"} <= set(
        evaluations
    )
    assert all(e.passed for e in evaluations.values()), {
        k: e.metadata for k, e in evaluations.items() if not e.passed
    }
    md = result.asset_materializations_for_node("hidden_states")[-1].metadata
    assert md["storage_dtype"].value == FP8 and md["bytes_per_token"].value < 0.55 * bytes_per_token(
        H, "bfloat16"
    )
    spot = evaluations["hidden_states_spot_check"].metadata
    assert "float8_e4m3fn" in spot["rule"].value and spot["max_token_norm_deviation"].value < 2**-4


def test_the_served_spot_check_reads_fp8_and_fails_rolled_scales(chat, fp8_extracted, smollm2_dir):
    """From pieces of the checkpoint (a served target): the shallowest aux layer dequantized passes, its
    scales one row off fail on magnitude."""
    from eagle3_assets.core.hidden_states.spot_pieces import AnswerDecoding, spot_check_pieces
    from eagle3_assets.core.target_model.pieces import CheckpointPieces

    layout, _ = fp8_extracted
    folder = layout.hidden_states_dir
    pieces = CheckpointPieces.find(str(smollm2_dir))
    ids = sorted(HiddenStatesReader(folder).ids())
    sampled = AnswerDecoding.of(0.7)  # the canned answers are not the target's greedy ones
    right = spot_check_pieces(folder, pieces, ids, sampled)
    assert right.passed, right.metadata

    def roll(t, _meta):
        t["aux_hidden_states_scales"] = torch.roll(t["aux_hidden_states_scales"], 1, dims=0).contiguous()

    rewrite_every_shard(layout.hidden_states_dir, roll)
    wrong = spot_check_pieces(folder, pieces, ids, sampled)
    assert not wrong.passed  # every cosine unchanged: only the magnitude shows
    assert wrong.metadata["min_token_cosine"] == pytest.approx(right.metadata["min_token_cosine"], abs=1e-5)


def test_a_shard_naming_another_model_is_not_deleted_but_fails_consistency(chat, tmp_path):
    """Only what a shard holds (storage dtype, layers) makes it stale; a renamed model path must not cost the
    states: the consistency check names it instead."""
    layout = write_tokens(chat, tmp_path, n=4)
    s = extraction_settings()
    extract_dataset(layout, s, **QUIET)
    before = set(finished_shards(layout.hidden_states_dir))
    rewrite_every_shard(
        layout.hidden_states_dir, lambda _t, meta: meta.__setitem__("model", "/old/path/to/smollm2")
    )
    work, stats, _ = extract_dataset(layout, s, **QUIET)
    assert (
        work.stale_shards == []
        and stats.samples == 0
        and set(finished_shards(layout.hidden_states_dir)) == before
    )
    assert verdicts(layout, s)["consistent"] is False


def test_quantize_follows_the_contract():
    """scale = absmax / 448 per (token, layer) block; dequantized = x.float().view(T, n, -1) * scales[...,
    None]; a block of zeros gets scale 1 (a stored zero scale is always a fault)."""
    from eagle3_assets.core.hidden_states.fp8 import dequantize, quantize, scale_problems

    x = torch.randn(5, 3 * 8, generator=torch.Generator().manual_seed(0)) * torch.tensor(
        [1.0, 100.0, 1e-3]
    ).repeat_interleave(8)
    x[2] = 0.0
    q, scales = quantize(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scales.dtype == torch.float32 and scales.shape == (5, 3)
    blocks = x.view(5, 3, 8)
    assert torch.allclose(scales[[0, 1, 3, 4]], blocks.abs().amax(-1)[[0, 1, 3, 4]] / 448)
    assert torch.equal(scales[2], torch.ones(3)) and scale_problems(scales) == 0
    assert (
        q.float().view(5, 3, 8).abs().amax(-1)[[0, 1, 3, 4]].eq(448).all()
    )  # each block uses the full range
    assert torch.equal(dequantize(q, scales), (q.float().view(5, 3, -1) * scales[..., None]).view(5, -1))
    rel = (dequantize(q, scales) - x).abs() / x.abs().clamp_min(1e-30)
    assert float(rel[x.abs() > blocks.abs().amax(-1).repeat_interleave(8, -1) / 64].max()) <= 2**-4
    bad = scales.clone()
    bad[0, 0], bad[1, 1], bad[3, 2] = 0.0, float("inf"), -1.0
    assert scale_problems(bad) == 3
