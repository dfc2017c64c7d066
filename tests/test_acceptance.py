"""The acceptance gate on the real embedded target: a partition of the target's own answers passes it through
Dagster (asset, blocking check, report, a draft that loads back), speculative decoding gives exactly the
target's greedy answer, training and inference see the same draft function, and each kind of wrong data fails
the gate: hidden states shifted by one position, aux states of other samples, a loss mask shifted by one."""

from __future__ import annotations

import itertools
import json
import shutil

import dagster as dg
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle3_assets.assets.acceptance import gate_engines
from eagle3_assets.config import load_config
from eagle3_assets.core.acceptance.decoding import SpeculativeDecoder
from eagle3_assets.core.acceptance.drafter import (
    Eagle3Draft,
    StepKV,
    TrainSample,
    load_checkpoint,
    ttt_forward,
)
from eagle3_assets.core.acceptance.gate import run_gate
from eagle3_assets.core.acceptance.samples import load_samples, rendered_prompts, split_ids
from eagle3_assets.core.hidden_states.draft_format import DraftShape
from eagle3_assets.core.hidden_states.extraction import load_target_model
from eagle3_assets.core.hidden_states.reader import StoredStates
from eagle3_assets.core.hidden_states.shards import finished_shards
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.definitions import (
    ACCEPTANCE_JOB,
    HIDDEN_STATES_JOB,
    TRAINING_DATA_JOB,
    build_definitions,
)

from .support.projects import REPO

pytestmark = pytest.mark.slow

# Small enough for 2 cores (about a minute a gate), large enough that a fit and a heldout gain are clear.
GATE = {"train_prompts": 8, "heldout_prompts": 4, "max_new_tokens": 32, "train_steps": 100}


def _checks(result) -> dict[str, dg.AssetCheckEvaluation]:
    return {
        e.asset_check_evaluation_data.check_name: e.asset_check_evaluation_data
        for e in result.all_events
        if e.event_type_value == "ASSET_CHECK_EVALUATION"
    }


@pytest.fixture(scope="module")
def gated(tmp_path_factory):
    """B3 (code, with the source's own answers) answered by the embedded target, its hidden states, the
    gate."""
    root = tmp_path_factory.mktemp("acceptance")
    shutil.copy(REPO / "prompts" / "B3.jsonl", root / "B3.jsonl")
    cfg = {
        "storage": {"root": "data"},
        "datasets": {"B3": {"source": "B3.jsonl", "format": "instruction", "max_tokens": 48}},
        "acceptance": GATE,
    }
    path = root / "eagle3.yaml"
    path.write_text(json.dumps(cfg))
    config = load_config(path)
    defs = build_definitions(config, str(path))
    with dg.instance_for_test() as instance:
        for job, run_config in (
            (TRAINING_DATA_JOB, {"ops": {"responses": {"config": {"limit": 14}}}}),
            (HIDDEN_STATES_JOB, None),
            (ACCEPTANCE_JOB, None),
        ):
            result = defs.resolve_job_def(job).execute_in_process(
                partition_key="B3", instance=instance, run_config=run_config, raise_on_error=False
            )
            assert result.success, (job, [e.message for e in result.all_events if e.is_failure])
    return config, DatasetLayout(root / "data", "B3"), result


def test_the_targets_own_answers_pass_the_gate_and_the_draft_loads_back(gated):
    config, layout, result = gated
    check = _checks(result)["acceptance_gate"]
    assert check.passed, check.metadata
    report = json.loads((layout.acceptance_dir / "report.json").read_text())
    k = report["draft_tokens"]
    assert k == 4
    for part in ("train", "heldout", "untrained"):
        p = report[part]
        assert set(p) >= {"acceptance_length", "per_position", "n_prompts", "n_steps"}
        assert len(p["per_position"]) == k and 1.0 <= p["acceptance_length"] <= k + 1
    assert report["train"]["acceptance_length"] >= 0.8 * (k + 1)
    assert report["heldout"]["acceptance_length"] > report["untrained"]["acceptance_length"]
    # The acceptance length the heldout step accuracy implies, beside the served one.
    sim = report["simulated"]
    assert 0 < sim["acceptance_length"] <= k + 1 and len(sim["per_position"]) == k
    assert sim["served_acceptance_length"] == report["heldout"]["acceptance_length"]
    assert (
        report["heldout"]["n_prompts"] == 3 and report["train"]["n_prompts"] == 3
    )  # a quarter of 14 held out
    assert report["boundaries"] == {"checked": 11, "bad": 0, "examples": {}}  # 8 trained + 3 held out
    # The source's own answers, trained the same way and measured on the same heldout prompts.
    assert report["source_answers"]["n_samples"] >= 5
    assert 1.0 <= report["source_answers"]["heldout"]["acceptance_length"] <= k + 1
    md = result.asset_materializations_for_node("acceptance")[-1].metadata
    assert md["heldout_acceptance_length"].value == report["heldout"]["acceptance_length"]

    # The draft in SGLang/SpecForge's layout: config keys, weight names and shapes, d2t/t2d consistent.
    folder = layout.acceptance_dir / "draft"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    # vLLM reads the ids as output_hidden_states indices (decoder outputs [1, 14, 26] + 1), SGLang as layer
    # outputs.
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    sglang = json.loads((folder / "config.sglang.json").read_text())
    assert sglang["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
    assert report["engine"] == "transformers" and report["max_new_tokens"] == GATE["max_new_tokens"]
    assert report["heldout"]["prompt_ids"] == report["heldout_ids"]
    assert report["greedy_check"]["equal"] == report["greedy_check"]["prompts"] == 3
    state = load_file(str(folder / "model.safetensors"))
    h, vd = cfg["hidden_size"], cfg["draft_vocab_size"]
    assert state["fc.weight"].shape == (h, 3 * h)
    assert state["midlayer.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert state["lm_head.weight"].shape == (vd, h)
    assert "embed_tokens.weight" not in state  # the target's, as SpecForge exports drafts
    assert torch.equal(torch.nonzero(state["t2d"]).flatten(), state["d2t"] + torch.arange(len(state["d2t"])))
    model = load_target_model_for(config)
    draft = load_checkpoint(folder, model.get_input_embeddings().weight.detach().float())
    assert torch.equal(draft.fc.weight, state["fc.weight"])


def load_target_model_for(config):
    from eagle3_assets.core.hidden_states.extraction import ExtractionSettings

    return load_target_model(ExtractionSettings.from_config(config))


def test_speculative_decoding_gives_exactly_the_targets_greedy_answer(gated):
    config, layout, _ = gated
    model = load_target_model_for(config)
    chat = _chat(config)
    draft = load_checkpoint(
        layout.acceptance_dir / "draft", model.get_input_embeddings().weight.detach().float()
    )
    folder = layout.hidden_states_dir
    ids = StoredStates.read(folder).output_hidden_states_ids
    stop = {chat.eot_id, chat.tok.eos_token_id}
    decoder = SpeculativeDecoder(model, ids, stop, "cpu")
    train_ids, heldout_ids = split_ids(sorted(finished_ids(layout)), 8, 4)
    samples = load_samples(layout, [train_ids[0], heldout_ids[0]])
    accepted_some = False
    for prompt in rendered_prompts(chat, samples):
        rounds, generated = decoder.decode(draft, prompt, 4, 24)
        accepted_some |= any(rounds)
        greedy = model.generate(
            torch.tensor([prompt]), max_new_tokens=len(generated), do_sample=False, eos_token_id=sorted(stop)
        )[0, len(prompt) :].tolist()
        assert generated == greedy
    assert accepted_some  # the trained draft's tokens were accepted, so the accept path ran


def finished_ids(layout) -> list[str]:
    import polars as pl

    return pl.read_parquet(layout.hidden_states_dir / "index.parquet")["id"].to_list()


def _chat(config):
    from resources import Target

    return Target(config).chat_tokenizer()


def test_training_and_inference_compute_the_same_draft_chain():
    """The TTT rows (positions t + j, step-0 keys of rows <= t, the row's own chain) are exactly what the
    decoder computes when it drafts from row t with the true tokens forced."""
    torch.manual_seed(0)
    shape = DraftShape(64, 128, 4, 2, 16, 300, 300)
    draft = Eagle3Draft(shape, torch.randn(300, 64), torch.arange(300)).eval()
    n = 20
    sample = TrainSample(torch.randint(0, 300, (n,)), torch.ones(n, dtype=torch.long), torch.randn(n, 192))
    with torch.no_grad():
        steps = {o.step: o for o in ttt_forward(draft, [sample], 4)}
        t = 9  # a row well inside the sample
        rows = torch.arange(t + 1)
        mask = torch.tril(torch.ones(t + 1, t + 1, dtype=torch.bool))
        out, ctx = draft.step(sample.input_ids[1 : t + 2], draft.fc(sample.aux[: t + 1]), rows, mask)
        assert torch.allclose(out[t], steps[0].states[t], atol=1e-5)
        hidden, chain = out[t : t + 1], []
        ones = torch.ones(1, t + 1, dtype=torch.bool)
        for j in range(1, 4):
            token = sample.input_ids[t + 1 + j : t + 2 + j]
            hidden, kv = draft.step(token, hidden, torch.tensor([t + j]), ones, ctx, chain)
            chain.append(StepKV(kv.k, kv.v))
            row = int(torch.nonzero(steps[j].rows == t))
            assert torch.allclose(hidden[0], steps[j].states[row], atol=1e-5), j


def _rewrite(folder, change) -> None:
    for name in finished_shards(folder):
        path = folder / name
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            meta = dict(f.metadata())
        change(tensors)
        save_file(tensors, str(path), metadata=meta)


def _per_sample(tensors, key, fn) -> None:
    cu = tensors["cu_seqlens"].tolist()
    x = tensors[key].clone()
    for a, b in itertools.pairwise(cu):
        x[a:b] = fn(x[a:b])
    tensors[key] = x


def _shift_states(t):
    for key in ("aux_hidden_states", "last_hidden_state"):
        _per_sample(t, key, lambda x: torch.roll(x, 1, 0))


def _other_samples(t):
    t["aux_hidden_states"] = torch.roll(t["aux_hidden_states"], t["aux_hidden_states"].shape[0] // 2, 0)


def _shift_mask(t):
    _per_sample(t, "loss_mask", lambda x: torch.roll(x, 1, 0))


@pytest.mark.parametrize(
    "corrupt, reason",
    [
        (_shift_states, "does not fit its own training prompts"),
        (_other_samples, "does not fit its own training prompts"),
        (_shift_mask, "loss mask off the template's answer span"),
    ],
    ids=["states-shifted-by-one", "aux-of-other-samples", "loss-mask-shifted-by-one"],
)
def test_wrong_data_fails_the_gate(gated, tmp_path, corrupt, reason):
    config, layout, _ = gated
    copy = DatasetLayout(tmp_path, "B3")
    shutil.copytree(layout.dir, copy.dir, ignore=shutil.ignore_patterns("acceptance", "exports"))
    _rewrite(copy.hidden_states_dir, corrupt)
    settings = config.acceptance.model_copy(update={"compare_source_answers": False})
    chat = _chat(config)
    engines = gate_engines(config, copy, chat, log=lambda m: None)
    result = run_gate(copy, settings, engines, chat, log=lambda m: None)
    assert not result.passed
    assert any(reason in r for r in result.reasons), result.reasons
    report = json.loads((copy.acceptance_dir / "report.json").read_text())
    assert report["gate"]["passed"] is False and report["gate"]["reasons"] == result.reasons


def test_the_gate_trains_on_dequantized_fp8_states_and_passes(gated, tmp_path):
    """The same partition's states extracted again in FP8 (hidden_states.storage_dtype: float8_e4m3fn): the
    gate reads them dequantized, trains and passes; heldout acceptance against the bf16 states' is printed
    (one run each: the difference is within the gate's own run-to-run noise, not measured here)."""
    from eagle3_assets.core.hidden_states.extraction import ExtractionSettings, extract_dataset

    config, layout, _ = gated
    copy = DatasetLayout(tmp_path, "B3")
    shutil.copytree(
        layout.dir, copy.dir, ignore=shutil.ignore_patterns("acceptance", "exports", "hidden_states")
    )
    fp8 = config.model_copy(
        update={"hidden_states": config.hidden_states.model_copy(update={"storage_dtype": "float8_e4m3fn"})}
    )
    extract_dataset(copy, ExtractionSettings.from_config(fp8), log=lambda m: None)
    assert {m["dtype"] for m in finished_shards(copy.hidden_states_dir).values()} == {"float8_e4m3fn"}
    settings = config.acceptance.model_copy(update={"compare_source_answers": False})
    chat = _chat(config)
    result = run_gate(
        copy, settings, gate_engines(fp8, copy, chat, log=lambda m: None), chat, log=lambda m: None
    )
    assert result.passed, result.reasons
    mine = json.loads((copy.acceptance_dir / "report.json").read_text())
    bf16 = json.loads((layout.acceptance_dir / "report.json").read_text())
    k = mine["draft_tokens"]
    assert mine["train"]["acceptance_length"] >= 0.8 * (k + 1)
    assert mine["heldout"]["acceptance_length"] > mine["untrained"]["acceptance_length"]
    print(
        f"heldout acceptance length: FP8 {mine['heldout']['acceptance_length']:.3f}, bf16 "
        f"{bf16['heldout']['acceptance_length']:.3f}; train FP8 {mine['train']['acceptance_length']:.3f}, "
        f"bf16 {bf16['train']['acceptance_length']:.3f}"
    )
