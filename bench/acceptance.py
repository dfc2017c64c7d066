"""The acceptance gate's cost on one demo partition (B3, code), on this machine, with the shipped defaults.

Builds the partition the way `make demo` does (the embedded target answers B3's prompts; hidden states on this
device), then times each phase of the gate. Baseline, measured in the same run: plain greedy decoding of the
same measured prompts with the target (`generate`, the same number of new tokens), so the measurement phases
read as a multiple of "just decoding them". Also printed: acceptance lengths (train, heldout, untrained floor,
the source's own answers) and the speed-up they imply in target forwards. Then the same partition's states are
extracted again in FP8 (`storage_dtype: float8_e4m3fn`) and the gate runs again on them: heldout acceptance on
FP8 states against bf16.

`python -m bench acceptance` (`--quick`: 12 prompts, 60 training steps, 32 new tokens).
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from eagle3_assets.core.acceptance.gate_report import GateReport

REPO = Path(__file__).resolve().parent.parent


def _partition(folder: Path, limit: int) -> tuple[object, Path]:
    import dagster as dg

    from eagle3_assets.config import load_config
    from eagle3_assets.definitions import HIDDEN_STATES_JOB, TRAINING_DATA_JOB, build_definitions

    shutil.copy(REPO / "eagle3.yaml", folder / "eagle3.yaml")
    shutil.copytree(REPO / "prompts", folder / "prompts")
    path = folder / "eagle3.yaml"
    cfg = load_config(path)
    defs = build_definitions(cfg, str(path))
    with dg.instance_for_test() as instance:
        for job, run_config in (
            (TRAINING_DATA_JOB, {"ops": {"responses": {"config": {"limit": limit}}}}),
            (HIDDEN_STATES_JOB, None),
        ):
            result = defs.resolve_job_def(job).execute_in_process(
                partition_key="B3", instance=instance, run_config=run_config
            )
            assert result.success
    return cfg, path


def _acceptance_lengths(report: GateReport) -> dict[str, float]:
    return {
        "train": report.train.acceptance_length,
        "heldout": report.heldout.acceptance_length,
        "untrained": report.untrained.acceptance_length,
    }


def run(quick: bool = False) -> dict:
    import torch

    from eagle3_assets.assets.acceptance import gate_engines
    from eagle3_assets.core.acceptance.gate import run_gate
    from eagle3_assets.core.acceptance.samples import load_samples, rendered_prompts
    from eagle3_assets.core.hidden_states.extraction import (
        ExtractionSettings,
        extract_dataset,
        load_target_model,
    )
    from eagle3_assets.core.storage.layout import DatasetLayout
    from eagle3_assets.core.target_model.loading import pick_device
    from resources import Target

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        t0 = time.perf_counter()
        cfg, _ = _partition(folder, 12 if quick else 1000)
        build_s = time.perf_counter() - t0
        settings = cfg.acceptance
        if quick:
            settings = settings.model_copy(update={"train_steps": 60, "max_new_tokens": 32})
        layout = DatasetLayout(cfg.storage_root, "B3")
        model = load_target_model(ExtractionSettings.from_config(cfg))
        chat = Target(cfg).chat_tokenizer()
        device = pick_device(settings.device)
        engines = gate_engines(cfg, layout, chat, log=lambda m: None)
        r = run_gate(layout, settings, engines, chat, log=lambda m: None)

        # Baseline: plain greedy decoding of the prompts the gate measured, as many new tokens.
        heldout = load_samples(layout, r.heldout_ids, chat=chat)
        prompts = rendered_prompts(chat, heldout)
        stop = sorted(chat.stop_ids)
        t0 = time.perf_counter()
        with torch.no_grad():
            for p in prompts:
                model.generate(
                    torch.tensor([p], device=device),
                    max_new_tokens=settings.max_new_tokens,
                    do_sample=False,
                    eos_token_id=stop,
                )
        greedy_s = time.perf_counter() - t0

        # The same partition stored in FP8 (changing storage_dtype recomputes every shard), the gate again.
        hs = cfg.hidden_states.model_copy(update={"storage_dtype": "float8_e4m3fn"})
        cfg_fp8 = cfg.model_copy(update={"hidden_states": hs})
        extract_dataset(layout, ExtractionSettings.from_config(cfg_fp8), log=lambda m: None)
        engines = gate_engines(cfg_fp8, layout, chat, log=lambda m: None)
        fp8 = run_gate(layout, settings, engines, chat, log=lambda m: None)

    secs = r.seconds
    measured_parts = 3 + (1 if r.source_heldout_acceptance_length is not None else 0)
    result = {
        "device": device,
        "samples_trained": r.training.samples,
        "heldout_prompts": r.heldout.n_prompts,
        "seconds": secs,
        "partition_build_s": round(build_s, 1),
        "greedy_decode_heldout_s": round(greedy_s, 1),
        "acceptance_length": _acceptance_lengths(r)
        | {"source_answers_heldout": r.source_heldout_acceptance_length},
        "gate_passed": r.passed,
        "measured_parts": measured_parts,
        "fp8": {
            "acceptance_length": _acceptance_lengths(fp8),
            "gate_passed": fp8.passed,
            "heldout_vs_bf16": fp8.heldout.acceptance_length - r.heldout.acceptance_length,
        },
    }
    print(
        f"B3 on {device}: {result['samples_trained']} samples trained, {result['heldout_prompts']} heldout "
        f"prompts, k = {r.draft_tokens}, {settings.train_steps} training steps"
    )
    print(f"{'phase':34} {'seconds':>8}")
    for name, value in secs.items():
        print(f"{name:34} {value:>8.1f}")
    print(
        f"baseline: greedy decoding of the heldout prompts {greedy_s:.1f} s; measuring the untrained draft "
        f"on them {secs['measure_untrained'] / greedy_s:.1f}x that (each of its rounds is a target forward "
        f"that accepts nothing), the whole gate {secs['total'] / greedy_s:.0f}x"
    )
    al = result["acceptance_length"]
    src = al["source_answers_heldout"]
    print(
        f"acceptance length (tokens per target forward): train {al['train']:.2f}, heldout "
        f"{al['heldout']:.2f}, untrained {al['untrained']:.2f}, trained on the source's own answers "
        + (f"{src:.2f}" if src is not None else "n/a")
        + f"; gate {'passed' if result['gate_passed'] else 'FAILED'}"
    )
    f = result["fp8"]["acceptance_length"]
    print(
        f"FP8 states (storage_dtype: float8_e4m3fn), the same gate: train {f['train']:.2f}, heldout "
        f"{f['heldout']:.2f} ({result['fp8']['heldout_vs_bf16']:+.2f} vs bf16), untrained "
        f"{f['untrained']:.2f}; gate {'passed' if result['fp8']['gate_passed'] else 'FAILED'}"
    )
    print(json.dumps({"partition_build_s": result["partition_build_s"]}))
    return result
