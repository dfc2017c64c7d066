"""data_value (not partitioned; GPU pool, CPU for the embedded target): what each dataset's data buys. A draft
per partition with stored hidden states, one on all of them and, opt-in, one on all but each, measured on a
common held-out suite with the gate's engine, beside the dollars, tokens and GPU-seconds each cost
(`core.data_value`); and its check `data_value_drafts_beat_floor`."""

from collections.abc import Callable
from dataclasses import dataclass

import dagster as dg

from resources import Project, Storage, Target

from ..config import ProjectConfig
from ..core.data_value.inputs import value_inputs
from ..core.data_value.run import Engines, PartitionData, read_partition, run_data_value
from ..core.data_value.suite import load_suite, refuse_overlaps
from ..core.data_value.value_report import FLOOR, DataValueReport, table
from ..core.storage.data_version import (
    InputsVersion,
    forget_inputs_version,
    record_inputs_version,
    recorded_inputs_version,
    unchanged_since,
)
from ..core.storage.layout import DATA_VALUE_DIR, DATA_VALUE_REPORT, DatasetLayout
from ..core.storage.versions import content_version
from ..core.target_model.chat import ChatTokenizer
from .acceptance import gate_engines
from .common import GROUP, refuse_another_targets_answers
from .hidden_states import GPU_STEP_TAGS

NOT_CONFIGURED = (
    "not configured: add a `data_value` section to the config (data_value.suite: a prompt file or a dataset "
    "key) to measure what each dataset buys; nothing was measured"
)


def extraction_seconds(instance: dg.DagsterInstance, key: str) -> float:
    """Seconds of target forwards spent extracting the partition's hidden states, over every materialisation
    of hidden_states: each records the tokens it extracted and their rate (`index_hidden_states`)."""
    records = instance.fetch_materializations(
        dg.AssetRecordsFilter(asset_key=dg.AssetKey("hidden_states"), asset_partitions=[key]), limit=10_000
    ).records
    total = 0.0
    for r in records:
        m = r.asset_materialization
        md = m.metadata if m is not None else {}
        tokens, rate = md.get("extracted_this_run_tokens"), md.get("forward_tokens_per_s")
        if tokens is not None and rate is not None and rate.value:
            total += float(tokens.value) / float(rate.value)  # type: ignore[arg-type]
    return total


def partitions_with_states(
    cfg: ProjectConfig, storage: Storage, held_out: str | None
) -> dict[str, DatasetLayout]:
    """Every training partition (the held-out suite dataset aside), checked out; those without stored states
    are left out of the drafts (the report says which were)."""
    return {k: storage.checkout(k, "acceptance") for k in cfg.datasets if k != held_out}


def _metadata(r: DataValueReport) -> dict:
    trained = [x for x in r.rows if x.draft != FLOOR]
    best = max(trained, key=lambda x: x.acceptance_length)
    priced = [x for x in trained if x.usd_per_0_1_acceptance is not None]
    cheapest = min(priced, key=lambda x: x.usd_per_0_1_acceptance or 0.0) if priced else None
    flagged = [x.draft for x in r.rows if any(f.startswith("degenerate-loop") for f in x.flags)]
    return {
        "drafts": dg.MetadataValue.md(table(r)),
        "suite_prompts": r.suite.n_prompts,
        "suite_source": r.suite.source,
        "floor_acceptance_length": r.floor_acceptance_length,
        "best_draft": best.draft,
        "best_acceptance_length": best.acceptance_length,
        "cheapest_0_1_acceptance": cheapest.draft if cheapest else "none priced",
        "cheapest_usd_per_0_1_acceptance": (
            cheapest.usd_per_0_1_acceptance if cheapest else dg.MetadataValue.null()
        ),
        "drafts_with_loops": dg.MetadataValue.json(flagged),
        "engine": r.engine,
        "seconds": r.seconds["total"],
        "device": r.device,
    }


@dataclass
class Measured:
    report: DataValueReport
    inputs: InputsVersion
    reused: bool  # the stored report was computed from exactly these inputs: nothing was trained
    changed: list[str]  # the inputs that changed since the stored report (all of them where there was none)


def measure_value(
    cfg: ProjectConfig,
    storage: Storage,
    chat: ChatTokenizer,
    instance: dg.DagsterInstance,
    log: Callable[[str], None],
) -> Measured:
    """The suite (refused where it overlaps a training prompt: before any training), the inputs version (the
    stored report re-reported where it is unchanged), each partition's training samples and cost, the gate's
    engines, then every draft."""
    assert cfg.data_value is not None
    suite = load_suite(cfg)
    layouts = partitions_with_states(cfg, storage, suite.held_out_dataset)
    refuse_overlaps(suite, {k: lay.prompts for k, lay in layouts.items()})
    with_states = {k: lay for k, lay in layouts.items() if lay.hidden_states_index.exists()}
    if not with_states:
        raise ValueError("data_value: no partition has stored hidden states; materialise hidden_states first")
    skipped = sorted(set(layouts) - set(with_states))
    if skipped:
        log(f"data_value: no hidden states yet for {', '.join(skipped)}: left out of every draft")
    folder = storage.root / DATA_VALUE_DIR
    inputs = value_inputs(cfg, with_states, chat.fingerprint())
    stored = read_value_report(storage)
    if stored is not None and unchanged_since(folder, inputs) is not None:
        log(
            f"data_value: inputs unchanged (version {inputs.version}): the stored report stands; nothing "
            "was trained"
        )
        return Measured(stored, inputs, True, [])
    previous = recorded_inputs_version(folder)
    changed = inputs.changed(previous.inputs if previous else None)
    log(f"data_value: measuring; changed since the stored report: {', '.join(changed)}")
    forget_inputs_version(folder)  # a run that dies halfway leaves no record naming inputs it did not finish
    data: dict[str, PartitionData] = {}
    for k, lay in with_states.items():
        refuse_another_targets_answers(lay, cfg, k)
        data[k] = read_partition(lay, cfg.acceptance, chat, extraction_seconds(instance, k))
    first = next(iter(with_states.values()))
    g = gate_engines(cfg, first, chat, log)
    report = run_data_value(
        suite,
        data,
        cfg.acceptance,
        Engines(g.target, g.measurer, g.target_name),
        chat,
        folder,
        cfg.data_value.leave_one_out,
        log,
    )
    record_inputs_version(folder, inputs)  # last: only a finished report is named by its inputs
    return Measured(report, inputs, False, changed)


def build_data_value_asset() -> dg.AssetsDefinition:
    @dg.asset(
        name="data_value",
        deps=["hidden_states"],
        group_name=GROUP,
        pool="gpu",
        op_tags=GPU_STEP_TAGS,
        kinds={"pytorch"},
        code_version="1",
        description="What each dataset buys: a draft per partition, one on all of them and (leave_one_out) "
        "one on all but each, trained as the acceptance gate's and measured on a common held-out suite "
        "(data_value.suite), beside each dataset's dollars, completion tokens and GPU-seconds, and the price "
        "of 0.1 acceptance length over the untrained floor (data_value/report.json, report.md).",
    )
    def data_value(
        context: dg.AssetExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
        target: dg.ResourceParam[Target],
    ) -> dg.MaterializeResult:
        cfg = project.cfg
        if cfg.data_value is None:
            context.log.warning(f"data_value: {NOT_CONFIGURED}")
            return dg.MaterializeResult(metadata={"status": NOT_CONFIGURED})
        got = measure_value(cfg, storage, target.chat_tokenizer(), context.instance, context.log.info)
        report, folder = got.report, storage.root / DATA_VALUE_DIR
        return dg.MaterializeResult(
            data_version=dg.DataVersion(content_version(report.model_dump(exclude={"seconds", "device"}))),
            metadata={
                "status": "reused: inputs unchanged" if got.reused else "measured",
                "reused": got.reused,
                "inputs_version": got.inputs.version,
                "inputs_changed": dg.MetadataValue.json(got.changed),
                **_metadata(report),
                "report_json": dg.MetadataValue.path(str(folder / "report.json")),
                "report_md": dg.MetadataValue.path(str(folder / "report.md")),
            },
        )

    return data_value


def read_value_report(storage: Storage) -> DataValueReport | None:
    path = storage.root / DATA_VALUE_REPORT
    if not path.exists():
        return None
    try:
        return DataValueReport.model_validate_json(path.read_text())
    except ValueError:  # an older shape or a hand edit: measured again, never a failing asset
        return None


def build_data_value_checks() -> list[dg.AssetChecksDefinition]:
    @dg.asset_check(
        asset="data_value",
        description="Every trained draft beats the untrained floor on the suite (one that does not bought "
        "nothing measurable with its data); fails while data_value is not configured or not measured.",
    )
    def data_value_drafts_beat_floor(
        project: dg.ResourceParam[Project], storage: dg.ResourceParam[Storage]
    ) -> dg.AssetCheckResult:
        warn = dg.AssetCheckSeverity.WARN
        if project.cfg.data_value is None:
            return dg.AssetCheckResult(passed=False, severity=warn, metadata={"reason": NOT_CONFIGURED})
        report = read_value_report(storage)
        if report is None:
            return dg.AssetCheckResult(
                passed=False, severity=warn, metadata={"reason": "no report.json: materialise data_value"}
            )
        below = {
            x.draft: x.acceptance_length
            for x in report.rows
            if x.draft != FLOOR and x.acceptance_length <= report.floor_acceptance_length
        }
        return dg.AssetCheckResult(
            passed=not below,
            severity=warn,
            metadata={
                "floor_acceptance_length": report.floor_acceptance_length,
                "drafts_not_above_floor": dg.MetadataValue.json(below),
            },
        )

    return [data_value_drafts_beat_floor]
