"""Asset checks, stored per partition. Blocking checks keep bad data from flowing on to later stages.

The rules live in `core.validation`; this module only reads the partition's files and reports the verdicts.
"""

import json

import dagster as dg
import polars as pl

from resources import Project, Storage, Target

from .core import validation
from .core.store import FAILURE_SCHEMA, RESPONSE_SCHEMA, JournalTable

MISSING = dg.AssetCheckResult(
    passed=False, metadata={"reason": "the asset's file is missing: materialise it"}
)


def _result(v: validation.Verdict, warn: bool = False) -> dg.AssetCheckResult:
    severity = dg.AssetCheckSeverity.WARN if warn else dg.AssetCheckSeverity.ERROR
    return dg.AssetCheckResult(passed=v.passed, severity=severity, metadata=v.metadata)


def _tokens(storage: Storage, key: str, columns: list[str]) -> pl.DataFrame | None:
    path = storage.layout(key).tokens
    return pl.read_parquet(path, columns=columns) if path.exists() else None


def build_checks(partitions: dg.PartitionsDefinition) -> list[dg.AssetChecksDefinition]:
    @dg.asset_check(
        asset="responses",
        blocking=True,
        partitions_def=partitions,
        description="No prompt id has two stored responses.",
    )
    def responses_unique_ids(
        context: dg.AssetCheckExecutionContext, storage: dg.ResourceParam[Storage]
    ) -> dg.AssetCheckResult:
        table = JournalTable(storage.layout(context.partition_key).responses_dir, RESPONSE_SCHEMA)
        return _result(validation.unique_ids(table.scan(["id"]).collect()["id"]))

    @dg.asset_check(
        asset="responses",
        partitions_def=partitions,
        description="Share of prompts whose last attempt failed stays under checks.max_failure_share.",
    )
    def responses_failure_share(
        context: dg.AssetCheckExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
    ) -> dg.AssetCheckResult:
        layout = storage.layout(context.partition_key)
        n_prompts = (
            pl.scan_parquet(layout.prompts).select(pl.len()).collect().item()
            if layout.prompts.exists()
            else 0
        )
        n_fail = len(JournalTable(layout.failures_dir, FAILURE_SCHEMA).keys())
        return _result(
            validation.failure_share(n_fail, n_prompts, project.cfg.checks.max_failure_share), warn=True
        )

    @dg.asset_check(
        asset="tokens",
        blocking=True,
        partitions_def=partitions,
        description="Every row's input_ids and loss_mask have the same length.",
    )
    def tokens_lengths_match(
        context: dg.AssetCheckExecutionContext, storage: dg.ResourceParam[Storage]
    ) -> dg.AssetCheckResult:
        df = _tokens(storage, context.partition_key, ["id", "input_ids", "loss_mask"])
        return MISSING if df is None else _result(validation.lengths_match(df))

    @dg.asset_check(
        asset="tokens",
        blocking=True,
        partitions_def=partitions,
        description="Rebuilt ids equal the model's own output ids for at least "
        "checks.min_reference_match_rate of the rows that have them (truncation tails excepted; fails "
        "when the 95% interval of the rate lies below the threshold).",
    )
    def tokens_reference_match(
        context: dg.AssetCheckExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
    ) -> dg.AssetCheckResult:
        df = _tokens(storage, context.partition_key, ["reference_match", "match_explained", "mismatch"])
        threshold = project.cfg.checks.min_reference_match_rate
        return MISSING if df is None else _result(validation.reference_match(df, threshold))

    @dg.asset_check(
        asset="tokens",
        blocking=True,
        partitions_def=partitions,
        description="Every finished answer (finish_reason=stop) ends with the trained end-of-turn token.",
    )
    def tokens_end_of_turn(
        context: dg.AssetCheckExecutionContext,
        storage: dg.ResourceParam[Storage],
        target: dg.ResourceParam[Target],
    ) -> dg.AssetCheckResult:
        df = _tokens(storage, context.partition_key, ["id", "input_ids", "loss_mask", "finish_reason"])
        eot = target.chat_tokenizer().eot_id
        return MISSING if df is None else _result(validation.end_of_turn_present(df, eot))

    @dg.asset_check(
        asset="validation_report",
        partitions_def=partitions,
        description="Warns when too many answers are truncated or degenerate (thresholds in checks.*).",
    )
    def report_answer_quality(
        context: dg.AssetCheckExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
    ) -> dg.AssetCheckResult:
        path = storage.layout(context.partition_key).report_json
        if not path.exists():
            return MISSING
        checks = project.cfg.checks
        verdict = validation.answer_quality(
            json.loads(path.read_text()), checks.max_truncated_share, checks.max_degenerate_share
        )
        return _result(verdict, warn=True)

    return [
        responses_unique_ids,
        responses_failure_share,
        tokens_lengths_match,
        tokens_reference_match,
        tokens_end_of_turn,
        report_answer_quality,
    ]
