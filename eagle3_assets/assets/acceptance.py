"""acceptance (GPU pool; CPU for the embedded target): a small EAGLE-3 draft trained on the partition's hidden
states and measured against the target. The blocking check `acceptance_gate` reads its report."""

import hashlib
import json

import dagster as dg

from resources import Project, Storage, Target

from ..core.acceptance import gate_verdict, run_gate
from ..core.extraction import load_target_model
from ..core.target import pick_device
from .common import GROUP
from .hidden_states import GPU_STEP_TAGS, extraction_settings


def _part(report: dict, name: str) -> dict:
    p = report.get(name) or {}
    return {
        f"{name}_acceptance_length": p.get("acceptance_length", 0.0),
        f"{name}_prompts": p.get("n_prompts", 0),
    }


def build_acceptance_asset(partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(
        name="acceptance",
        deps=["hidden_states"],
        partitions_def=partitions,
        group_name=GROUP,
        pool="gpu",
        op_tags=GPU_STEP_TAGS,
        kinds={"pytorch"},
        code_version="1",
        description="Trains a small EAGLE-3 draft on the partition's hidden states and measures it against the "
        "target with greedy speculative decoding (acceptance/report.json, the draft in SGLang/SpecForge layout "
        "beside it). Check acceptance_gate: the draft fits its training prompts and beats an untrained one "
        "on heldout prompts.",
    )
    def acceptance(
        context: dg.AssetExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
        target: dg.ResourceParam[Target],
    ) -> dg.MaterializeResult:
        cfg = project.cfg
        key = context.partition_key
        layout = storage.checkout(key, "acceptance")
        settings = extraction_settings(cfg)
        device = pick_device(cfg.acceptance.device)
        model = load_target_model(settings)
        result = run_gate(
            layout, cfg.acceptance, model, target.chat_tokenizer(), device, log=context.log.info
        )
        storage.publish(key, "acceptance")
        r = result.report
        content = {k: v for k, v in r.items() if k not in ("seconds", "device")}
        passed, reasons = gate_verdict(r, cfg.acceptance)
        source = r["source_answers"]
        return dg.MaterializeResult(
            data_version=dg.DataVersion(
                hashlib.blake2b(json.dumps(content, sort_keys=True).encode(), digest_size=8).hexdigest()
            ),
            metadata={
                "draft_tokens": r["draft_tokens"],
                **_part(r, "train"),
                **_part(r, "heldout"),
                **_part(r, "untrained"),
                "heldout_per_position": dg.MetadataValue.json(r["heldout"]["per_position"]),
                "source_answers_heldout_acceptance_length": (
                    source["heldout"]["acceptance_length"] if "heldout" in source else dg.MetadataValue.null()
                ),
                "source_answers": dg.MetadataValue.json(source),
                "gate_passed": passed,
                "gate_reasons": dg.MetadataValue.json(reasons),
                "training": dg.MetadataValue.json(r["training"]),
                "seconds": r["seconds"]["total"],
                "device": r["device"],
                "report_json": dg.MetadataValue.path(str(layout.acceptance_dir / "report.json")),
                "draft": dg.MetadataValue.path(str(layout.acceptance_dir / "draft")),
            },
        )

    return acceptance
