"""Asset checks, stored per partition. Blocking checks keep bad data from flowing on to later stages."""

import json

import dagster as dg
import polars as pl

from resources import ProjectConfigResource, StorageResource, TargetTokenizerResource

from .core.report import wilson_interval
from .core.store import FAILURE_SCHEMA, RESPONSE_SCHEMA, JournalTable


def _tokens(storage: StorageResource, key: str, columns: list[str]) -> pl.DataFrame | None:
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
        context: dg.AssetCheckExecutionContext, storage: StorageResource
    ) -> dg.AssetCheckResult:
        ids = (
            JournalTable(storage.layout(context.partition_key).responses_dir, RESPONSE_SCHEMA)
            .scan(["id"])
            .collect()
        )
        dupes = ids.height - ids["id"].n_unique()
        return dg.AssetCheckResult(passed=dupes == 0, metadata={"rows": ids.height, "duplicate_ids": dupes})

    @dg.asset_check(
        asset="responses",
        partitions_def=partitions,
        description="Share of prompts whose last attempt failed stays under checks.max_failure_share.",
    )
    def responses_failure_share(
        context: dg.AssetCheckExecutionContext, project: ProjectConfigResource, storage: StorageResource
    ) -> dg.AssetCheckResult:
        layout = storage.layout(context.partition_key)
        limit = project.load().checks.max_failure_share
        n_prompts = (
            pl.scan_parquet(layout.prompts).select(pl.len()).collect().item()
            if layout.prompts.exists()
            else 0
        )
        n_fail = len(JournalTable(layout.failures_dir, FAILURE_SCHEMA).keys())
        share = n_fail / n_prompts if n_prompts else 0.0
        return dg.AssetCheckResult(
            passed=share <= limit,
            severity=dg.AssetCheckSeverity.WARN,
            metadata={"failures": n_fail, "prompts": n_prompts, "share": share, "limit": limit},
        )

    @dg.asset_check(
        asset="tokens",
        blocking=True,
        partitions_def=partitions,
        description="Every row's input_ids and loss_mask have the same length.",
    )
    def tokens_lengths_match(
        context: dg.AssetCheckExecutionContext, storage: StorageResource
    ) -> dg.AssetCheckResult:
        df = _tokens(storage, context.partition_key, ["id", "input_ids", "loss_mask"])
        if df is None:
            return dg.AssetCheckResult(passed=False, metadata={"reason": "tokens.parquet is missing"})
        bad = df.filter(pl.col("input_ids").list.len() != pl.col("loss_mask").list.len())
        no_loss = df.filter(pl.col("loss_mask").list.sum() == 0).height
        return dg.AssetCheckResult(
            passed=bad.height == 0,
            metadata={
                "rows": df.height,
                "length_mismatches": bad.height,
                "rows_without_trained_tokens": no_loss,
                "examples": json.dumps(bad["id"].head(5).to_list()),
            },
        )

    @dg.asset_check(
        asset="tokens",
        blocking=True,
        partitions_def=partitions,
        description="Reconstructed ids equal the model's own output ids for at least "
        "checks.min_reference_match_rate of the rows that have them (truncation tails excepted; fails "
        "when the 95% interval of the rate lies below the threshold).",
    )
    def tokens_reference_match(
        context: dg.AssetCheckExecutionContext, project: ProjectConfigResource, storage: StorageResource
    ) -> dg.AssetCheckResult:
        df = _tokens(storage, context.partition_key, ["reference_match", "match_explained", "mismatch"])
        threshold = project.load().checks.min_reference_match_rate
        if df is None:
            return dg.AssetCheckResult(passed=False, metadata={"reason": "tokens.parquet is missing"})
        refs = df.filter(pl.col("reference_match").is_not_null())
        if refs.height == 0:
            return dg.AssetCheckResult(
                passed=True, metadata={"reference_rows": 0, "note": "no reference ids"}
            )
        exact = int(refs["reference_match"].sum())
        explained = int(refs["match_explained"].sum())
        low, high = wilson_interval(explained, refs.height)
        kinds = refs["mismatch"].drop_nulls().value_counts().rows()
        # Differences confined to the cut of a truncated answer are not reconstruction errors (the text cannot
        # tell which ids a cut-off word had); everything else counts. Fails when the 95% interval of the rate
        # lies below the threshold, so 1 unlucky row in 28 does not block a dataset but a real defect does.
        return dg.AssetCheckResult(
            passed=high >= threshold,
            metadata={
                "exact_rate": exact / refs.height,
                "rate_excluding_truncation_tails": explained / refs.height,
                "threshold": threshold,
                "reference_rows": refs.height,
                "interval_95": f"{low:.4f}-{high:.4f}",
                "mismatch_kinds": json.dumps(dict(kinds)),
            },
        )

    @dg.asset_check(
        asset="tokens",
        blocking=True,
        partitions_def=partitions,
        description="Every finished answer (finish_reason=stop) ends with the end-of-turn token.",
    )
    def tokens_end_of_turn(
        context: dg.AssetCheckExecutionContext, storage: StorageResource, target: TargetTokenizerResource
    ) -> dg.AssetCheckResult:
        df = _tokens(storage, context.partition_key, ["id", "input_ids", "finish_reason"])
        if df is None:
            return dg.AssetCheckResult(passed=False, metadata={"reason": "tokens.parquet is missing"})
        eot = target.chat_tokenizer().eot_id
        finished = df.filter(pl.col("finish_reason") == "stop")
        bad = finished.filter(pl.col("input_ids").list.last() != eot)
        return dg.AssetCheckResult(
            passed=bad.height == 0,
            metadata={
                "finished_rows": finished.height,
                "missing_end_of_turn": bad.height,
                "end_of_turn_id": eot,
                "examples": json.dumps(bad["id"].head(5).to_list()),
            },
        )

    @dg.asset_check(
        asset="validation_report",
        partitions_def=partitions,
        description="Warns when too many answers are truncated or degenerate (thresholds in checks.*).",
    )
    def report_answer_quality(
        context: dg.AssetCheckExecutionContext, project: ProjectConfigResource, storage: StorageResource
    ) -> dg.AssetCheckResult:
        path = storage.layout(context.partition_key).report_json
        checks = project.load().checks
        if not path.exists():
            return dg.AssetCheckResult(passed=False, metadata={"reason": "report.json is missing"})
        r = json.loads(path.read_text())
        passed = r["truncated_share"] <= checks.max_truncated_share and (
            r["degenerate_share"] <= checks.max_degenerate_share
        )
        return dg.AssetCheckResult(
            passed=passed,
            severity=dg.AssetCheckSeverity.WARN,
            metadata={
                "truncated_share": r["truncated_share"],
                "max_truncated_share": checks.max_truncated_share,
                "degenerate_share": r["degenerate_share"],
                "max_degenerate_share": checks.max_degenerate_share,
                "empty_answers": r["empty_answers"],
            },
        )

    return [
        responses_unique_ids,
        responses_failure_share,
        tokens_lengths_match,
        tokens_reference_match,
        tokens_end_of_turn,
        report_answer_quality,
    ]
