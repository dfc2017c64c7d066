"""Run inside the SpecForge environment: SpecForge 0.2.0's own offline path over an export, on CPU.

    python read_specforge.py EXPORT DRAFT --steps 3 [--max-length 256]

- The export's `specforge_train.yaml` is loaded and validated by SpecForge's config schema (`--max-length`
  overrides its `data.max_length`, as a user's `data.max_length=N` would); its eagle3 algorithm's offline
  reader, sample transform (the `max_length` cut) and collator read every record through SpecForge's
  `FeatureDataLoader`, and the ids and masks that reach a batch are compared with the files.
- SpecForge's `TargetHead`, loaded from the target folder the config names, predicts the next answer token
  from the exported last state.
- The export's `vocab_mapping.pt` is compared with the maps SpecForge derives itself from the same records.
- `AutoDraftModel.from_pretrained` loads the acceptance gate's draft; every stored tensor must be used.
- `specforge train --config specforge_train.yaml` (its CLI entry point, in a child process) trains the draft
  for a few steps. CPU only: FSDP needs an accelerator (`fsdp_sharding=NO_SHARD` selects SpecForge's DDP
  path), flex attention has no CPU backward (sdpa), and the Triton loss kernel cannot launch without a GPU
  driver, so the loss is SpecForge's own eager reference of the same kernel. The draft trains in the config's
  bf16 where the CPU has bf16 arithmetic, in fp32 (`model.torch_dtype=float32`) elsewhere
  (`driver.training_precision`). Prints one JSON line; never imports the project.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from driver import offline, report, training_precision

offline()  # the frameworks, imported in main(), read these settings at import

CPU_OVERRIDES = [
    "training.fsdp_sharding=NO_SHARD",
    "training.attention_backend=sdpa",
    "training.num_epochs=1",
    "training.log_interval=1",
    "data.dataloader_num_workers=0",
]


def main() -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("export")
    p.add_argument("draft")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--max-length", type=int, default=None, help="override the run config's data.max_length")
    a = p.parse_args()
    overrides = [*CPU_OVERRIDES, *([f"data.max_length={a.max_length}"] if a.max_length is not None else [])]

    import torch
    from safetensors.torch import load_file
    from specforge.application import resolve_run
    from specforge.config import load_config
    from specforge.data.preprocessing import process_token_dict_to_mappings
    from specforge.launch import _offline_io
    from specforge.modeling.auto import AutoDraftModel
    from specforge.modeling.target.target_head import TargetHead
    from specforge.runtime.data_plane import FeatureDataLoader, LocalFeatureStore
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from specforge.training.vocab_mapping import count_effective_feature_tokens

    export = Path(a.export)
    out: dict = {}
    work = Path(tempfile.mkdtemp(prefix="read-specforge-"))
    run_config = export / "specforge_train.yaml"
    cfg = load_config(str(run_config), [*overrides, f"data.cache_dir={work / 'cache'}"])
    max_len = out["max_length"] = cfg.data.max_length
    algorithm = resolve_run(cfg).algorithm
    reader = algorithm.providers.offline_for("text").build_reader(
        str(export), run_id="read", ttt_length=cfg.training.ttt_length, max_len=max_len
    )
    refs = reader.read()
    collate, transform = _offline_io(
        algorithm, "text", max_len, ttt_length=cfg.training.ttt_length, use_usp_preprocess=False
    )
    loader = FeatureDataLoader(
        LocalFeatureStore("read"), refs=refs, batch_size=1, collate_fn=collate,
        per_sample_transform=transform,
        drop_last=True, strategy="eagle3", ack=False, num_workers=0,
    )  # fmt: skip
    head = TargetHead.from_pretrained(cfg.model.target_model_path, lm_head_key=cfg.model.lm_head_key)
    equal, hits, total, shapes = [], 0, 0, set()
    for ref, batch in zip(refs, loader, strict=True):
        raw = load_feature_file(ref.feature_store_uri[len("file://") :])
        t = batch.tensors
        n = min(int(raw["input_ids"].numel()), max_len)
        mask = raw["loss_mask"][:n].clone()
        mask[-1] = 0  # SpecForge's transform never trains the last position (it has no next token)
        equal.append(
            torch.equal(t["input_ids"][0], raw["input_ids"][:n])
            and torch.equal(t["loss_mask"][0].long(), mask)
        )
        shapes.add((tuple(t["hidden_state"].shape[2:]), tuple(t["target"].shape[2:]), str(t["target"].dtype)))
        with torch.no_grad():
            pred = head(t["target"][0].to(head.fc.weight.dtype)).argmax(-1)
        ids, answer = t["input_ids"][0], t["loss_mask"][0][1:].bool()
        hits += int((pred[:-1] == ids[1:])[answer].sum())
        total += int(answer.sum())
    out["n_samples"] = len(refs)
    out["ids_and_masks_equal"] = all(equal)
    out["feature_shapes"] = sorted(map(list, shapes))
    out["target_head_top1"] = hits / max(total, 1)

    draft_cfg = json.loads(Path(cfg.model.draft_model_config).read_text())
    ours = torch.load(cfg.model.vocab_mapping_path, weights_only=True)
    with contextlib.redirect_stdout(io.StringIO()):  # SpecForge prints its progress
        counts = count_effective_feature_tokens(
            str(export), max_length=max_len, target_vocab_size=draft_cfg["vocab_size"]
        )
        d2t, t2d = process_token_dict_to_mappings(
            counts, draft_cfg["draft_vocab_size"], draft_cfg["vocab_size"]
        )
    mass = {"ours": sum(counts.get(int(i), 0) for i in ours["t2d"].nonzero().flatten().tolist())}
    mass["specforge"] = sum(counts.get(int(i), 0) for i in t2d.nonzero().flatten().tolist())
    out["vocab_mapping"] = {
        "d2t": list(ours["d2t"].shape),
        "t2d": list(ours["t2d"].shape),
        "draft_vocab_size": draft_cfg["draft_vocab_size"],
        "trained_token_mass": mass,  # the same share of trained tokens, whatever order ties are broken in
        "offsets_consistent": sorted((ours["d2t"] + torch.arange(len(ours["d2t"]))).tolist())
        == ours["t2d"].nonzero().flatten().tolist(),
        "specforge_shapes": [list(d2t.shape), list(t2d.shape)],
    }

    stored = load_file(str(Path(a.draft) / "model.safetensors"))
    model, info = AutoDraftModel.from_pretrained(a.draft, output_loading_info=True)
    state = model.state_dict()
    out["draft"] = {
        "class": type(model).__name__,
        "missing": sorted(info.get("missing_keys", [])),
        "unexpected": sorted(info.get("unexpected_keys", [])),
        "unused_stored": sorted(
            k for k, v in stored.items() if k not in state or not torch.equal(state[k].to(v.dtype), v)
        ),
        "vocab_mapping_matches_weights": all(
            torch.equal(v, stored[k])
            for k, v in torch.load(Path(a.draft) / "vocab_mapping.pt", weights_only=True).items()
        ),
    }

    if a.steps:
        out["train_dtype"] = train_dtype = training_precision()[0]
        overrides = [
            *overrides,
            f"training.max_steps={a.steps}",
            *([] if train_dtype == "bfloat16" else [f"model.torch_dtype={train_dtype}"]),
            f"data.cache_dir={work / 'cache'}",
            f"output_dir={work / 'run'}",
        ]
        metrics = work / "metrics.json"
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
        child = subprocess.run(
            [sys.executable, __file__, "--train", str(run_config), str(metrics), *overrides],
            capture_output=True, text=True, env=env, timeout=900,
        )  # fmt: skip
        steps = json.loads(metrics.read_text()) if metrics.exists() else {"error": child.stderr[-3000:]}
        out["train"] = steps
        losses = [m["loss"] for m in steps.get("metrics", []) if "loss" in m]
        out["losses"] = losses
        out["losses_finite"] = bool(losses) and all(math.isfinite(x) for x in losses)
    return out


def train(config: str, metrics_path: str, overrides: list[str]) -> None:
    """`specforge train --config CONFIG OVERRIDES...`, with the eager loss on CPU and the logged metrics
    kept."""
    import specforge.algorithms.eagle3.model as eagle3_model
    import specforge.training.assembly as assembly
    import torch
    from specforge import cli
    from specforge.core import loss

    if not torch.cuda.is_available():
        reference = getattr(loss._compute_loss, "_torchdynamo_orig_callable", loss._compute_loss)

        class EagerLogSoftmaxLoss:  # the Triton kernel's own reference implementation
            apply = staticmethod(reference)

        eagle3_model.LogSoftmaxLoss = EagerLogSoftmaxLoss
    dtype, _, cast = training_precision()
    if dtype == "float32":  # the draft is fp32 (`model.torch_dtype`): the stored bf16 states are cast up
        forward = eagle3_model.OnlineEagle3Model.forward

        def forward_fp32(self, *args, **kwargs):
            return forward(self, *map(cast, args), **cast(kwargs))

        eagle3_model.OnlineEagle3Model.forward = forward_fp32
    logged: list[dict] = []
    log = assembly._logger

    def keep(metrics: dict, step: int) -> None:
        row = {"step": int(step)}
        for k in ("loss", "acc", "grad_norm"):
            with contextlib.suppress(TypeError, ValueError):
                row[k] = float(metrics.get(k, metrics.get(f"train/{k}")))
        logged.append(row)
        log(metrics, step)

    assembly._logger = keep
    result: dict = {}
    try:
        result["rc"] = cli.main(["train", "--config", config, *overrides])
    except BaseException as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"[:3000]
        result["traceback"] = traceback.format_exc()[-3000:]
    result["metrics"] = logged
    Path(metrics_path).write_text(json.dumps(result))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--train"]:
        train(sys.argv[2], sys.argv[3], sys.argv[4:])
        sys.exit(0)
    report(main)
