"""What the asset modules share: the group, metadata tables, and how a check's verdict becomes its result."""

from collections.abc import Callable, Mapping
from typing import Any

import dagster as dg
import polars as pl
from dagster._core.execution.backfill import BulkActionStatus
from dagster._core.storage.tags import BACKFILL_ID_TAG

from resources import Storage

from ..config import ProjectConfig
from ..core.generation.identity import TargetIdentity, TargetMismatch, answers_target_problem
from ..core.generation.stopping import StopProbe
from ..core.report.validation import Verdict
from ..core.storage.layout import DatasetLayout

GROUP = "eagle3"

MISSING = dg.AssetCheckResult(
    passed=False, metadata={"reason": "the asset's file is missing: materialise it"}
)


def refuse_another_targets_answers(layout: DatasetLayout, cfg: ProjectConfig, key: str) -> None:
    """A stage past generation works only on the answers of the config's target: tokens, states and a draft
    made from another target's answers would be trained as this one's."""
    problem = answers_target_problem(layout.target_identity, TargetIdentity.from_config(cfg), key)
    if problem is not None:
        raise TargetMismatch(problem)


def counts_table(counts: Mapping[str, Any], key: str = "kind", value: str = "count") -> dg.TableMetadataValue:
    schema = dg.TableSchema(columns=[dg.TableColumn(key, "string"), dg.TableColumn(value, "int")])
    rows = [dg.TableRecord({key: str(k), value: int(v)}) for k, v in counts.items()]
    return dg.MetadataValue.table(rows, schema=schema)


def check_result(v: Verdict, warn: bool = False) -> dg.AssetCheckResult:
    """A rule's verdict (core.report.validation) as a check result; `warn` for checks that do not block."""
    severity = dg.AssetCheckSeverity.WARN if warn else dg.AssetCheckSeverity.ERROR
    return dg.AssetCheckResult(passed=v.passed, severity=severity, metadata=v.metadata)


def scan_tokens(storage: Storage, key: str, columns: list[str]) -> pl.LazyFrame | None:
    """The partition's token rows, lazily: each check reduces them to what it needs (streaming, bounded
    memory)."""
    path = storage.checkout(key, "tokens").tokens
    return pl.scan_parquet(path).select(columns) if path.exists() else None


def check_each_partition(
    context: dg.AssetCheckExecutionContext, evaluate: Callable[[str], dg.AssetCheckResult]
) -> dg.AssetCheckResult:
    """A partitioned check, in a run of one partition or of a range (the single-run backfill of `responses`).

    Dagster gives a check in a range run no partition of its own, so each partition's result is logged as that
    partition's evaluation (what the UI and automation read per partition), and the step's own result
    summarises them."""
    keys = list(context.partition_keys)
    if len(keys) == 1:
        return evaluate(keys[0])
    spec = context.check_specs[0]
    failed = []
    for key in keys:
        r = evaluate(key)
        if not r.passed:
            failed.append(key)
        # log_event records check evaluations too (one per partition here); its annotation lists only the
        # others.
        context.op_execution_context.log_event(
            dg.AssetCheckEvaluation(  # type: ignore[arg-type]
                asset_key=spec.asset_key,
                check_name=spec.name,
                passed=r.passed,
                metadata=r.metadata,
                severity=r.severity,
                partition=key,
                blocking=spec.blocking,
            )
        )
    return dg.AssetCheckResult(
        passed=not failed,
        metadata={"partitions": ", ".join(keys), "failed_partitions": ", ".join(failed) or "none"},
        description="evaluated per partition (a run over several partitions); each partition's result is "
        "recorded under its partition",
    )


def operator_stop(context: dg.OpExecutionContext | dg.AssetExecutionContext) -> StopProbe:
    """Whether the operator stopped this run where no signal has come yet: the run is being terminated, or the
    backfill it belongs to was cancelled (which the backfill daemon passes on to its runs only at its next
    pass, up to 30 s later). On a cancelled backfill this run asks to be terminated itself, as the daemon
    would, so that it ends CANCELED."""
    instance, run_id = context.instance, context.run.run_id
    backfill_id = context.run.tags.get(BACKFILL_ID_TAG)
    asked: list[str] = []

    def probe() -> str | None:
        run = instance.get_run_by_id(run_id)
        if run is not None and run.status in (dg.DagsterRunStatus.CANCELING, dg.DagsterRunStatus.CANCELED):
            return "the run is being terminated"
        backfill = instance.get_backfill(backfill_id) if backfill_id else None
        if backfill is None or backfill.status not in (BulkActionStatus.CANCELING, BulkActionStatus.CANCELED):
            return None
        if not asked:
            asked.append(run_id)
            instance.run_coordinator.cancel_run(run_id)
        return f"backfill {backfill_id} was cancelled"

    return probe
