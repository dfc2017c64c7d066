"""acceptance (GPU pool; CPU for the embedded target): a small EAGLE-3 draft trained on the partition's hidden
states and measured against the target; and its blocking check `acceptance_gate`, which reports the verdict
the gate computed (once, in `core.acceptance.gate.run_gate`, stored in report.json)."""

from collections.abc import Callable
from dataclasses import asdict

import dagster as dg

from resources import Project, Storage, Target

from ..config import ProjectConfig
from ..core.acceptance.gate import GateEngines, run_gate
from ..core.acceptance.gate_report import GateReport, read_report
from ..core.acceptance.gate_version import (
    GATE_CODE_VERSION,
    GateOutcome,
    gate_inputs_version,
    versioned_gate,
)
from ..core.acceptance.measure import DraftTarget, PartMeasure
from ..core.hidden_states.extraction import ExtractionSettings, load_target_model
from ..core.hidden_states.reader import StoredStates
from ..core.storage.data_version import recorded_inputs_version
from ..core.storage.layout import DatasetLayout
from ..core.storage.versions import content_version
from ..core.target_model.chat import ChatTokenizer
from .common import GROUP, MISSING, refuse_another_targets_answers
from .hidden_states import GPU_STEP_TAGS


def gate_engines(
    cfg: ProjectConfig, layout: DatasetLayout, chat: ChatTokenizer, log: Callable[[str], None]
) -> GateEngines:
    """The draft's pieces of the target (config and embedding, read by tensor name), and the engine that
    measures it: the target in this process (`acceptance.engine: transformers`) or vLLM started by the step
    (`vllm`). The source-answers arm's states come from the engine that extracted the partition's own."""
    from ..core.acceptance.decoding import InProcessFeatures, InProcessMeasurer, SpeculativeDecoder
    from ..core.target_model.loading import pick_device

    settings = ExtractionSettings.from_config(cfg)
    t = cfg.target
    if cfg.acceptance.engine == "vllm":
        from resources.vllm.managed import ManagedServerError, prerequisites

        # Everything the step's servers need, checked before the pieces are read and the draft is trained.
        problems = prerequisites(cfg.acceptance.vllm, "acceptance.vllm")
        if problems:
            raise ManagedServerError(f"{layout.key}: nothing was trained:\n- " + "\n- ".join(problems))
    target = DraftTarget.load(settings.model_ref, t.revision, t.trust_remote_code)
    room_for_drafts(layout, target)
    feature_ids = StoredStates.read(layout.hidden_states_dir).output_hidden_states_ids
    stop_ids = chat.stop_ids
    a = cfg.acceptance
    if a.engine == "vllm":
        from resources.vllm.acceptance import VllmFeatures, VllmMeasurer

        from ..core.target_model.loading import cache_root

        # The servers' logs stay on the step's machine (named in any error), out of the partition's outputs.
        workdir = cache_root() / "acceptance-servers" / layout.key
        measurer = VllmMeasurer(cfg, sorted(stop_ids), workdir, log)
        if not a.compare_source_answers or cfg.hidden_states.engine == "vllm":
            features = VllmFeatures(cfg, layout.key, len(feature_ids), workdir, log)
            return GateEngines(target, measurer, features, t.model)
        return GateEngines(
            target,
            measurer,
            None,
            t.model,
            "with acceptance.engine vllm the source answers' states are extracted by vLLM, as the "
            "partition's own must have been for the two to compare (hidden_states.engine: vllm); this "
            "partition's were extracted in process",
        )
    device = pick_device(a.device)
    model = load_target_model(settings)
    decoder = SpeculativeDecoder(model, feature_ids, stop_ids, device)
    return GateEngines(
        target,
        InProcessMeasurer(decoder, a.draft_tokens, a.max_new_tokens),
        InProcessFeatures(model, feature_ids, device),
        t.model,
    )


def room_for_drafts(layout: DatasetLayout, target: DraftTarget) -> None:
    """Before any training: room for the drafts the gate writes (the trained one kept, the others while they
    are measured), each about a decoder layer, the fused input projection and the embedding of the target's
    size, in float32, twice over."""
    from ..core.hidden_states.sizing import NotEnoughSpace, free_bytes, human

    text = target.config.get_text_config()
    hidden = int(text.hidden_size)
    draft_bytes = 4 * (target.vocab_size * hidden * 2 + 16 * hidden * hidden)
    need, free = 2 * 3 * draft_bytes, free_bytes(layout.acceptance_dir)
    if free < need:
        raise NotEnoughSpace(
            f"{layout.key}: the gate's drafts need about {human(need)} where {layout.acceptance_dir} has "
            f"{human(free)} free; free space there or move storage.root. Nothing was trained."
        )


def _part(name: str, part: PartMeasure) -> dict:
    return {f"{name}_acceptance_length": part.acceptance_length, f"{name}_prompts": part.n_prompts}


def _simulated(r: GateReport) -> dict:
    """The acceptance length the heldout step accuracy implies, beside the served one and their ratio."""
    s = r.simulated
    if s is None:
        return {}
    return {
        "simulated_acceptance_length": s.acceptance_length,
        "served_heldout_acceptance_length": s.served_acceptance_length,
        "served_over_simulated": (
            s.served_over_simulated if s.served_over_simulated is not None else dg.MetadataValue.null()
        ),
        "simulated_per_position": dg.MetadataValue.json(s.per_position),
    }


def _metadata(r: GateReport) -> dict:
    """The report's figures on the asset's page."""
    source = r.source_heldout_acceptance_length
    return {
        "draft_tokens": r.draft_tokens,
        "engine": r.engine,
        "greedy_check": dg.MetadataValue.json(asdict(r.greedy_check)),
        **_part("train", r.train),
        **_part("heldout", r.heldout),
        **_part("untrained", r.untrained),
        "heldout_per_position": dg.MetadataValue.json(r.heldout.per_position),
        "source_answers_heldout_acceptance_length": source if source is not None else dg.MetadataValue.null(),
        "source_answers": dg.MetadataValue.json(r.source_answers.model_dump()),
        "gate_passed": r.passed,
        "gate_reasons": dg.MetadataValue.json(r.reasons),
        "training": dg.MetadataValue.json(r.training.model_dump()),
        **_simulated(r),
        "seconds": r.seconds["total"],
        "device": r.device,
    }


def _status(outcome: GateOutcome) -> str:
    """What this run did: re-reported the stored report (nothing trained or measured), or computed it and
    why."""
    version, at = outcome.recorded.inputs.version, outcome.recorded.recorded_at
    if outcome.reused:
        return f"unchanged since {at}, inputs {version}: the stored report, nothing trained or measured"
    if not outcome.had_record:
        why = "no earlier record: a first run, or the last one did not finish"
    elif outcome.changed:
        why = f"changed: {', '.join(outcome.changed)}"
    else:
        why = "inputs unchanged, but the stored report or draft was missing"
    return f"computed at {at} from inputs {version} ({why})"


def build_acceptance_asset(partitions: dg.PartitionsDefinition) -> dg.AssetsDefinition:
    @dg.asset(
        name="acceptance",
        deps=["hidden_states"],
        partitions_def=partitions,
        group_name=GROUP,
        pool="gpu",
        op_tags=GPU_STEP_TAGS,
        kinds={"pytorch"},
        code_version=GATE_CODE_VERSION,
        description="Trains a small EAGLE-3 draft on the partition's hidden states and measures it against "
        "the target with greedy speculative decoding (acceptance/report.json, the draft in SGLang/SpecForge "
        "layout beside it). A rerun whose inputs did not change (states, prompts, answers, settings, "
        "template, code: metadata `inputs`) re-reports the stored report without training. Check "
        "acceptance_gate: the draft fits its training prompts and beats an "
        "untrained one on heldout prompts.",
    )
    def acceptance(
        context: dg.AssetExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
        target: dg.ResourceParam[Target],
    ) -> dg.MaterializeResult:
        cfg, key = project.cfg, context.partition_key
        chat = target.chat_tokenizer()
        with storage.stage(key, "acceptance") as layout:
            refuse_another_targets_answers(layout, cfg, key)  # before any training
            inputs = gate_inputs_version(layout, cfg, chat.fingerprint())

            def run() -> GateReport:
                engines = gate_engines(cfg, layout, chat, context.log.info)
                return run_gate(layout, cfg.acceptance, engines, chat, log=context.log.info)

            outcome = versioned_gate(layout, inputs, run)
        report = outcome.report
        context.log.info(f"{key}: acceptance {_status(outcome)}")
        return dg.MaterializeResult(
            data_version=dg.DataVersion(content_version(report.model_dump(exclude={"seconds", "device"}))),
            metadata={
                **_metadata(report),
                "inputs_version": outcome.recorded.inputs.version,
                "inputs": dg.MetadataValue.json(outcome.recorded.inputs.parts),
                "computed_at": outcome.recorded.recorded_at,
                "status": _status(outcome),
                "report_json": dg.MetadataValue.path(str(layout.acceptance_report)),
                "draft": dg.MetadataValue.path(str(layout.draft_dir)),
            },
        )

    return acceptance


def build_acceptance_checks(partitions: dg.PartitionsDefinition) -> list[dg.AssetChecksDefinition]:
    @dg.asset_check(
        asset="acceptance",
        blocking=True,
        partitions_def=partitions,
        description="The draft trained on this partition fits its own training prompts (acceptance length ≥ "
        "acceptance.min_train_share × (k + 1)) and beats an untrained draft on heldout prompts; every "
        "answer's loss mask sits where the target's template puts it.",
    )
    def acceptance_gate(
        context: dg.AssetCheckExecutionContext, storage: dg.ResourceParam[Storage]
    ) -> dg.AssetCheckResult:
        layout = storage.checkout(context.partition_key, "acceptance")
        report = read_report(layout)
        if report is None:
            return MISSING
        recorded = recorded_inputs_version(layout.acceptance_dir)
        return dg.AssetCheckResult(
            passed=report.passed,
            metadata={
                "inputs_version": recorded.inputs.version if recorded else dg.MetadataValue.null(),
                **_simulated(report),
                "reasons": dg.MetadataValue.json(report.reasons),
                "train_acceptance_length": report.train.acceptance_length,
                "heldout_acceptance_length": report.heldout.acceptance_length,
                "untrained_acceptance_length": report.untrained.acceptance_length,
                "boundary_problems": report.boundaries.bad,
            },
        )

    return [acceptance_gate]
