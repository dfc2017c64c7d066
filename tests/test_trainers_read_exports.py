"""Every export is read, checked and trained on by the framework it is for: speculators 0.9.0, SpecForge 0.2.0
and Model-Optimizer 0.47.0, each its own code in its own environment (tests/support/consumers), on the shipped
defaults' B3.

An imitation of a consumer passed where the consumer failed (speculators' loader rejected an export whose test
had converted the ids itself), so nothing here reimplements a loader: the drivers call the frameworks' own
functions and report what they saw. Bad input (no samples, too few, samples longer than a consumer keeps, a
re-export over an earlier one) gets a clear error from the export or a file the consumer handles.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import polars as pl
import pytest

from eagle3_assets.config import HiddenStatesConfig
from eagle3_assets.core.hidden_states.exports.base import ExportError
from eagle3_assets.core.hidden_states.exports.export import FORMATS, export
from eagle3_assets.core.hidden_states.extraction import ExtractionSettings, extract_dataset
from eagle3_assets.core.hidden_states.reader import HiddenStatesReader
from eagle3_assets.core.storage.layout import DatasetLayout

from .support.consumers import environments

HERE = Path(environments.__file__).resolve().parent
# A test that meets a consumer first builds its environment (minutes of pip, once per machine) before its run:
# on a fresh, slow machine Model-Optimizer's build and first run took over the suite's 900 s.
pytestmark = [pytest.mark.slow, pytest.mark.consumers(*environments.CONSUMERS), pytest.mark.timeout(2400)]
N = 6  # the shipped-defaults run answers six prompts


def consume(name: str, *args: str | Path, cwd: Path) -> dict:
    """Run `read_<name>.py` in the framework's environment; its one JSON line, or the failure with its
    output."""
    python = environments.python(name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run(
        [str(python), str(HERE / f"read_{name}.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        env=env,
        timeout=1800,
    )
    lines = done.stdout.strip().splitlines()
    assert lines, f"{name} printed nothing (rc {done.returncode}):\n{done.stderr[-4000:]}"
    result = json.loads(lines[-1])
    assert "error" not in result, f"{result['error']}\n{result.get('traceback', '')}\n{done.stderr[-2000:]}"
    return result


@pytest.fixture(scope="module")
def exports(shipped_b3, tmp_path_factory) -> dict[str, Path]:
    assert shipped_b3.success, shipped_b3.failures
    base = tmp_path_factory.mktemp("exports")
    out = {fmt: base / fmt for fmt in FORMATS}
    for fmt, folder in out.items():
        assert export(shipped_b3.layout.hidden_states_dir, folder, fmt, log=lambda m: None) == N
    return out


def manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_every_export_names_its_target_layers_and_samples(exports, smollm2_dir):
    for fmt, folder in exports.items():
        m = manifest(folder)
        assert m["format"] == fmt and m["samples"] == N and m["dtype"] == "bfloat16"
        assert m["target"]["model"] == "builtin:smollm2" and m["target"]["num_hidden_layers"] == 30
        assert m["target"]["hidden_size"] == 576 and m["target"]["vocab_size"] == 49152
        assert m["aux_layer_ids"] == ([2, 15, 27] if fmt == "speculators" else [1, 14, 26])
        assert m["trained_tokens"] > 0 and m["truncated_samples"] == 0
        assert str(smollm2_dir) in m["train_command"] or fmt == "specforge"
    assert "--target-layer-ids 2 15 27" in manifest(exports["speculators"])["train_command"]
    assert "answer_only_loss=true" in manifest(exports["modelopt"])["train_command"]
    # Model-Optimizer reads every *.pt under its folder as a sample: nothing else may end in .pt.
    assert len(list(exports["modelopt"].rglob("*.pt"))) == N


def test_speculators_loads_checks_and_trains_on_its_export(exports, smollm2_dir, tmp_path):
    assert environments.versions("speculators")["speculators"] == "0.9.0"
    folder = exports["speculators"]
    r = consume(
        "speculators", folder, smollm2_dir, "--target-layer-ids", "2", "15", "27", "--draft-vocab-size", "64",
        cwd=tmp_path,
    )  # fmt: skip
    assert r["format_type"] == "torch"  # what its ArrowDataset needs (torch.equal on the ids)
    assert (
        r["n_samples"] == N and r["sample_failures"] == []
    )  # check_hidden_states + ArrowDataset[i], every sample
    assert r["token_freq_equals_recount"] and r["token_freq_entries"] > 64
    assert (
        r["d2t_from_token_freq"] and r["draft_vocab_size"] == 64
    )  # --draft-vocab-size built from token_freq.pt
    assert r["target_layer_ids"] == [2, 15, 27] and r["verifier_vocab"] == 49152
    assert r["target_head_top1"] > 0.95  # the last state is the verifier's, before its final norm
    assert r["loader_samples"] == N and r["loader_errors"] == 0
    assert len(r["losses"]) == 3 and r["losses_finite"], r["losses"]
    assert not list(folder.glob("*.npy"))  # the driver leaves the export as it found it


def test_speculators_refuses_an_export_without_the_torch_format(exports, smollm2_dir, tmp_path):
    """The defect this suite was built to catch, fed to the real loader: a dataset saved without the torch
    format fails at its first sample."""
    import datasets

    bad = tmp_path / "no-torch-format"
    shutil.copytree(exports["speculators"], bad, ignore=shutil.ignore_patterns("data-*.arrow", "*.json"))
    datasets.load_from_disk(str(exports["speculators"])).with_format(None).save_to_disk(str(bad))
    r = consume(
        "speculators", bad, smollm2_dir, "--target-layer-ids", "2", "15", "27", "--steps", "0", cwd=tmp_path
    )
    assert r["format_type"] is None
    assert len(r["sample_failures"]) == N and "must be Tensor" in r["sample_failures"][0]


@pytest.fixture(scope="module")
def fp8_export(shipped_b3, tmp_path_factory) -> Path:
    """The shipped B3's tokens extracted again with `storage_dtype: float8_e4m3fn`, exported for
    speculators."""
    root = tmp_path_factory.mktemp("fp8")
    layout = DatasetLayout(root, "B3").ensure()
    shutil.copy(shipped_b3.layout.tokens, layout.tokens)
    settings = ExtractionSettings(hidden=HiddenStatesConfig(storage_dtype="float8_e4m3fn"))
    extract_dataset(layout, settings, log=lambda m: None)
    out = root / "export"
    assert export(layout.hidden_states_dir, out, "speculators", log=lambda m: None) == N
    return out


def test_speculators_reads_fp8_states_through_fp8transfer_and_trains(fp8_export, smollm2_dir, tmp_path):
    """FP8 shards stay FP8 in the speculators export; hs-connectors' own FP8Transfer (`--hidden-states-backend
    fp8`) dequantizes them to what our reader gives, speculators' checks and loader accept them, and its draft
    trains."""
    m = manifest(fp8_export)
    assert m["dtype"] == "float8_e4m3fn" and m["dequantized"] is False
    assert m["train_command"].endswith("--hidden-states-backend fp8")
    r = consume(
        "speculators", fp8_export, smollm2_dir, "--target-layer-ids", "2", "15", "27",
        "--draft-vocab-size", "64",
        "--hidden-states-backend", "fp8", cwd=tmp_path,
    )  # fmt: skip
    assert r["transfer"] == "FP8Transfer"
    assert r["stored"]["hidden_states"] == "F8_E4M3" and r["stored"]["hidden_states_scales"] == "F32"
    assert r["read_as"] == ["torch.bfloat16"] and r["sample_failures"] == []
    import datasets

    ds = datasets.load_from_disk(str(fp8_export))
    reader = HiddenStatesReader(fp8_export.parent / "B3" / "hidden_states")
    assert len(r["hidden_states_abs_sums"]) == N
    for i, got in enumerate(r["hidden_states_abs_sums"]):
        s = reader.sample(ds[i]["id"])  # dequantized in float32
        want = float(sum(s[k].double().abs().sum() for k in ("aux_hidden_states", "last_hidden_state")))
        # FP8Transfer multiplies in bf16 (a scale rounded to 8 bits): the same states within that rounding.
        assert got == pytest.approx(want, rel=4e-3), i
    assert r["target_head_top1"] > 0.95  # dequantized last states still name the answer through the head
    assert r["loader_samples"] == N and r["loader_errors"] == 0
    assert len(r["losses"]) == 3 and r["losses_finite"], r["losses"]


def test_specforge_reads_its_export_loads_the_gate_draft_and_trains(exports, shipped_b3, tmp_path):
    assert environments.versions("specforge")["specforge"] == "0.2.0"
    draft = shipped_b3.layout.acceptance_dir / "draft"
    r = consume("specforge", exports["specforge"], draft, cwd=tmp_path)
    assert r["n_samples"] == N and r["ids_and_masks_equal"]
    assert r["feature_shapes"] == [[[1728], [576], "torch.bfloat16"]]  # aux 3H, last state H after the norm
    assert r["target_head_top1"] > 0.95  # SpecForge's target head on the exported post-norm state
    vm = r["vocab_mapping"]
    assert vm["d2t"] == [32000] and vm["t2d"] == [49152] and vm["specforge_shapes"] == [[32000], [49152]]
    assert vm["offsets_consistent"]
    assert vm["trained_token_mass"]["ours"] == vm["trained_token_mass"]["specforge"] > 0
    d = r["draft"]  # the acceptance gate's draft, as SpecForge loads a pretrained draft
    assert d["class"] == "LlamaForCausalLMEagle3"
    assert d["missing"] == ["embed_tokens.weight"] and d["unexpected"] == [] and d["unused_stored"] == []
    assert d["vocab_mapping_matches_weights"]
    assert r["train"].get("rc") == 0, r["train"]
    assert len(r["losses"]) == 3 and r["losses_finite"], r["losses"]


def test_model_optimizer_reads_and_trains_on_its_export(exports, smollm2_dir, tmp_path):
    assert environments.versions("modelopt")["nvidia-modelopt"] == "0.47.0"
    r = consume("modelopt", exports["modelopt"], smollm2_dir, "--aux", "1", "14", "26", cwd=tmp_path)
    assert r["offline"] and r["aux_layer_ids"] == [1, 14, 26]
    assert r["n_samples"] == N and r["bad_samples"] == []
    assert r["lm_head_top1"] > 0.95  # the stored last state is after the final norm
    assert len(r["losses"]) == 3 and r["losses_finite"] and r["losses"][0] > 0, r["losses"]


def test_samples_longer_than_max_len_are_cut_and_every_consumer_reads_them(shipped_b3, smollm2_dir, tmp_path):
    folder = shipped_b3.layout.hidden_states_dir
    longest = int(pl.read_parquet(folder / "index.parquet")["n_tokens"].max())
    cut = longest - 40
    outs = {fmt: tmp_path / fmt for fmt in FORMATS}
    for fmt, out in outs.items():
        logs: list[str] = []
        export(folder, out, fmt, log=logs.append, max_len=cut)
        m = manifest(out)
        assert m["max_len"] == cut and m["longest_sample"] == cut and m["longest_source_sample"] == longest
        assert m["truncated_samples"] >= 1 and any("cut to" in line for line in logs)
    s = consume(
        "speculators", outs["speculators"], smollm2_dir, "--target-layer-ids", "2", "15", "27",
        "--draft-vocab-size", "32", "--steps", "0", cwd=tmp_path,
    )  # fmt: skip
    assert s["sample_failures"] == [] and s["loader_samples"] == N
    f = consume(
        "specforge",
        outs["specforge"],
        shipped_b3.layout.acceptance_dir / "draft",
        "--steps",
        "0",
        cwd=tmp_path,
    )
    assert f["n_samples"] == N and f["ids_and_masks_equal"]
    o = consume(
        "modelopt", outs["modelopt"], smollm2_dir, "--aux", "1", "14", "26", "--steps", "0", cwd=tmp_path
    )
    assert o["n_samples"] == N and o["bad_samples"] == [] and o["longest"] == cut


def test_an_uncut_export_longer_than_each_consumers_limit_trains_in_each(
    exports, shipped_b3, smollm2_dir, tmp_path
):
    """No --max-len: each consumer meets samples longer than its own limit (speculators' total_seq_len,
    SpecForge's max_length, Model-Optimizer's training_seq_len) and cuts them itself, reading every sample and
    training."""
    longest = manifest(exports["modelopt"])["longest_sample"]
    limit = longest - 40
    assert all(
        manifest(f)["longest_sample"] == longest and manifest(f)["max_len"] is None for f in exports.values()
    )
    s = consume(
        "speculators", exports["speculators"], smollm2_dir, "--target-layer-ids", "2", "15", "27",
        "--draft-vocab-size", "32", "--total-seq-len", limit, "--steps", "2", cwd=tmp_path,
    )  # fmt: skip
    assert s["sample_failures"] == [] and s["loader_samples"] == N and s["loader_errors"] == 0
    assert len(s["losses"]) == 2 and s["losses_finite"] and s["losses"][0] > 0, s["losses"]
    f = consume(
        "specforge", exports["specforge"], shipped_b3.layout.acceptance_dir / "draft", "--max-length", limit,
        "--steps", "2", cwd=tmp_path,
    )  # fmt: skip
    # SpecForge cut the samples longer than `limit`; the ids and masks in its batches are compared up to the
    # cut.
    assert f["max_length"] == limit and f["n_samples"] == N and f["ids_and_masks_equal"]
    assert f["train"].get("rc") == 0, f["train"]
    assert len(f["losses"]) == 2 and f["losses_finite"] and f["losses"][0] > 0, f["losses"]
    o = consume(
        "modelopt", exports["modelopt"], smollm2_dir, "--aux", "1", "14", "26", "--train-len", limit,
        "--steps", "2",
        cwd=tmp_path,
    )  # fmt: skip
    # Model-Optimizer's dataset reads whole samples; its collator cuts them to `limit`.
    assert o["n_samples"] == N and o["bad_samples"] == [] and o["longest"] == longest
    assert len(o["losses"]) == 2 and o["losses_finite"] and o["losses"][0] > 0, o["losses"]


def test_a_cut_that_leaves_no_trained_token_is_refused_and_samples_it_empties_are_left_out(
    shipped_b3, smollm2_dir, tmp_path
):
    """A --max-len shorter than every prompt once exported 28 samples with no trained token, and speculators
    trained on them at loss 0.0. Now such a cut is refused with the max_len that keeps some, and a cut that
    empties only some samples leaves those out (counted in the manifest): every exported sample trains."""
    import torch

    folder = shipped_b3.layout.hidden_states_dir
    reader = HiddenStatesReader(folder)
    # The shortest cut that keeps a trained token before a sample's last position (SpecForge never trains the
    # last).
    need = sorted(int(reader.sample(sid)["loss_mask"][:-1].nonzero()[0, 0]) + 2 for sid in reader.ids())
    assert len(need) == N and need[0] < need[1] < need[-1]  # prompts of different lengths: cuts fall between
    for fmt in FORMATS:
        with pytest.raises(ExportError, match=rf"none of its {N} samples keeps a trained") as refused:
            export(folder, tmp_path / fmt, fmt, log=lambda m: None, max_len=need[0] - 1)
        k = FORMATS[fmt].min_samples
        assert f"max_len >= {need[k - 1]} to keep {k}" in str(refused.value)
        assert f">= {need[-1]} to keep every sample" in str(refused.value)
        assert not (tmp_path / fmt).exists()
    with pytest.raises(ExportError, match=r"only 1 of its .* speculators needs at least 2"):
        export(folder, tmp_path / "speculators", "speculators", log=lambda m: None, max_len=need[0])
    assert [p.name for p in tmp_path.iterdir()] == []  # refused before anything was written

    cut = need[1]
    kept = sum(x <= cut for x in need)
    outs = {fmt: tmp_path / fmt for fmt in FORMATS}
    for fmt, out in outs.items():
        logs: list[str] = []
        assert export(folder, out, fmt, log=logs.append, max_len=cut) == kept
        m = manifest(out)
        assert m["samples"] == kept and m["dropped_samples"] == N - kept and m["trained_tokens"] > 0
        assert any(f"{N - kept} samples were left out" in line for line in logs)
    for f in outs["modelopt"].glob("*.pt"):  # every sample a consumer reads has a token to train on
        assert torch.load(f, weights_only=True)["loss_mask"][:-1].sum() > 0, f.name
    s = consume(
        "speculators", outs["speculators"], smollm2_dir, "--target-layer-ids", "2", "15", "27",
        "--draft-vocab-size", "32", "--steps", "1", cwd=tmp_path,
    )  # fmt: skip
    assert s["sample_failures"] == [] and s["loader_samples"] == kept
    # Not the 0.0 of an export that trains nothing.
    assert s["losses_finite"] and s["losses"][0] > 0, s["losses"]


# -- bad input: a clear error from the export, never a file a consumer crashes on
# -----------------------------
def test_a_partition_without_samples_is_refused_with_the_fix(shipped_b3, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    for fmt in FORMATS:
        with pytest.raises(ExportError, match="holds 0 hidden-state sample"):
            export(empty, tmp_path / f"out-{fmt}", fmt, log=lambda m: None)
        assert not (tmp_path / f"out-{fmt}").exists()
    one = _subset(shipped_b3.layout.hidden_states_dir, tmp_path / "one", 1)
    with pytest.raises(ExportError, match="at least 2 samples"):
        export(one, tmp_path / "speculators-one", "speculators", log=lambda m: None)
    assert export(one, tmp_path / "modelopt-one", "modelopt", log=lambda m: None) == 1


def test_a_re_export_replaces_the_earlier_one_whole(shipped_b3, tmp_path):
    out = tmp_path / "modelopt"
    assert export(shipped_b3.layout.hidden_states_dir, out, "modelopt", log=lambda m: None) == N
    fewer = _subset(shipped_b3.layout.hidden_states_dir, tmp_path / "three", 3)
    assert export(fewer, out, "modelopt", log=lambda m: None) == 3
    assert len(list(out.rglob("*.pt"))) == 3  # no sample of the earlier export is left for rglob to find
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporaries left
    foreign = tmp_path / "notes"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("not an export")
    with pytest.raises(ExportError, match="not empty"):
        export(fewer, foreign, "modelopt", log=lambda m: None)
    assert (foreign / "mine.txt").exists()


def _subset(folder: Path, dest: Path, n: int) -> Path:
    """A copy of a hidden_states folder whose index lists only its first n samples."""
    shutil.copytree(folder, dest)
    pl.read_parquet(dest / "index.parquet").head(n).write_parquet(dest / "index.parquet")
    return dest
