"""data_value (not partitioned; GPU pool, CPU for the embedded target): what each dataset's data buys. A draft
per partition with stored hidden states, one on all of them and, opt-in, one on all but each, measured on a
common held-out suite with the gate's engine, beside the dollars, tokens and GPU-seconds each cost
(`core.data_value`); and its check `data_value_drafts_beat_floor`."""

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial

import dagster as dg

from resources import Inference, Project, Storage, Target

from ..config import ProjectConfig
from ..core.data_value.inputs import value_inputs
from ..core.data_value.run import Engines, PartitionData, read_partition, run_data_value
from ..core.data_value.store import publish, pull, read_stored, stored_files, value_layout
from ..core.data_value.suite import Suite, load_suite, refuse_overlaps, suite_guard
from ..core.data_value.suite_answers import SuiteAnswers, answer_suite
from ..core.data_value.value_report import FLOOR, DataValueReport, table
from ..core.prompts.context import PromptGuard
from ..core.storage.data_version import (
    InputsVersion,
    forget_inputs_version,
    record_inputs_version,
    recorded_inputs_version,
    unchanged_since,
)
from ..core.storage.layout import DATA_VALUE_DIR, DatasetLayout
from ..core.storage.root_files import RootFiles
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


def answer_the_suite(
    cfg: ProjectConfig,
    suite: Suite,
    storage: Storage,
    inference: Inference,
    chat: ChatTokenizer,
    log: Callable[[str], None],
) -> SuiteAnswers:
    """The suite answered like a partition, in `<root>/data_value/suite/`: with an object-store root its
    journal is pulled first, pushed at every flush and after, and one process answers it at a time (a lease
    in the store; a file lock locally)."""
    layout = value_layout(cfg)
    journal = layout.suite.ensure()
    remote, key, prefix = storage.remote, DATA_VALUE_DIR, [layout.suite_prefix()]
    lock: Callable[[str], AbstractContextManager] | None = None
    push: Callable[[], None] | None = None
    if remote is not None:
        remote.pull(key, prefix)
        lock = partial(remote.lease, key)

        def push() -> None:
            remote.push(key, prefix)

    try:
        backend = inference.create_backend(chat)
        return answer_suite(
            cfg, suite, journal, backend, chat, inference.engine_settings(), log, lock=lock, on_flush=push
        )
    finally:  # what was paid for is stored, after a failure too (the journal is append-only)
        if push is not None:
            push()


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
    guard: PromptGuard | None,
    inference: Inference,
) -> Measured:
    """The suite (its prompts too long for the target quarantined, and refused where it overlaps a training
    prompt: before any training), the inputs version (the stored report re-reported where it is unchanged),
    each partition's training samples and cost, the gate's engines, then every draft. With an object-store
    root the stored files are pulled first and published after."""
    assert cfg.data_value is not None
    suite = load_suite(cfg, guard)
    if suite.quarantined:
        log(
            f"data_value: {len(suite.quarantined)} suite prompt(s) quarantined, never measured: "
            + "; ".join(f"{k}: {v}" for k, v in list(suite.quarantined.items())[:10])
        )
    layouts = partitions_with_states(cfg, storage, suite.held_out_dataset)
    refuse_overlaps(suite, {k: lay.prompts for k, lay in layouts.items()})
    with_states = {k: lay for k, lay in layouts.items() if lay.hidden_states_index.exists()}
    if not with_states:
        raise ValueError("data_value: no partition has stored hidden states; materialise hidden_states first")
    answers = answer_the_suite(cfg, suite, storage, inference, chat, log)  # resumed: nothing bought twice
    skipped = sorted(set(layouts) - set(with_states))
    if skipped:
        log(f"data_value: no hidden states yet for {', '.join(skipped)}: left out of every draft")
    layout = value_layout(cfg)
    folder = layout.dir
    files = stored_files(cfg)
    if cfg.storage_is_remote:
        pull(files, layout)
    inputs = value_inputs(cfg, with_states, chat.fingerprint(), layout.suite)
    stored = read_value_report(cfg)
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
        answers,
    )
    record_inputs_version(folder, inputs)  # last: only a finished report is named by its inputs
    if cfg.storage_is_remote:
        log(f"data_value: stored {', '.join(publish(files, layout))}")
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
        inference: dg.ResourceParam[Inference],
    ) -> dg.MaterializeResult:
        cfg = project.cfg
        if cfg.data_value is None:
            context.log.warning(f"data_value: {NOT_CONFIGURED}")
            return dg.MaterializeResult(metadata={"status": NOT_CONFIGURED})
        a = cfg.acceptance
        got = measure_value(
            cfg,
            storage,
            target.chat_tokenizer(),
            context.instance,
            context.log.info,
            suite_guard(target.context_guard(), a.max_new_tokens + a.draft_tokens),
            inference,
        )
        report, layout = got.report, value_layout(cfg)
        files = stored_files(cfg)
        return dg.MaterializeResult(
            data_version=dg.DataVersion(content_version(report.model_dump(exclude={"seconds", "device"}))),
            metadata={
                "status": "reused: inputs unchanged" if got.reused else "measured",
                "reused": got.reused,
                "inputs_version": got.inputs.version,
                "inputs_changed": dg.MetadataValue.json(got.changed),
                **_metadata(report),
                "suite_quarantined": dg.MetadataValue.json(report.suite.quarantined),
                "report_json": dg.MetadataValue.path(stored_path(files, layout.rel(layout.report_json))),
                "report_md": dg.MetadataValue.path(stored_path(files, layout.rel(layout.report_md))),
            },
        )

    return data_value


def stored_path(files: RootFiles, rel: str) -> str:
    """Where `rel` is stored, as a reader names it (a local path, or the object's URL)."""
    return files.sql_path(rel) or rel


def read_value_report(cfg: ProjectConfig) -> DataValueReport | None:
    """The stored report (in the object store for an object-store root), None where there is none."""
    layout = value_layout(cfg)
    text = read_stored(stored_files(cfg), layout, layout.report_json)
    if text is None:
        return None
    try:
        return DataValueReport.model_validate_json(text)
    except ValueError:  # an older shape or a hand edit: measured again, never a failing asset
        return None


def build_data_value_checks() -> list[dg.AssetChecksDefinition]:
    @dg.asset_check(
        asset="data_value",
        description="Every trained draft beats the untrained floor on the suite (one that does not bought "
        "nothing measurable with its data); fails while data_value is not configured or not measured.",
    )
    def data_value_drafts_beat_floor(project: dg.ResourceParam[Project]) -> dg.AssetCheckResult:
        warn = dg.AssetCheckSeverity.WARN
        if project.cfg.data_value is None:
            return dg.AssetCheckResult(passed=False, severity=warn, metadata={"reason": NOT_CONFIGURED})
        report = read_value_report(project.cfg)
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
