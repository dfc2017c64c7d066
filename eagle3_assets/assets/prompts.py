"""prompts: the dataset source normalised into chat messages with stable ids; bad rows and over-long prompts
quarantined; and its check."""

import dagster as dg
import polars as pl
import pyarrow.parquet as pq

from resources import Project, Storage, Target

from ..core.prompts.ingest import PROMPT_SCHEMA, QUARANTINE_SCHEMA, quarantine_reasons, write_prompts
from ..core.report import validation
from ..core.storage.quarantine import parquet_problem
from ..core.storage.versions import file_version
from .common import GROUP, MISSING, check_each_partition, check_result, counts_table


def build_prompts_asset(
    partitions: dg.PartitionsDefinition, automation_condition: dg.AutomationCondition | None = None
) -> dg.AssetsDefinition:
    @dg.asset(
        name="prompts",
        partitions_def=partitions,
        automation_condition=automation_condition,
        group_name=GROUP,
        kinds={"python", "parquet"},
        code_version="3",
        description="Source rows (ShareGPT, OpenAI messages or instruction format) as chat messages ending "
        "in a user turn, one row per prompt with a stable id; unusable rows, and prompts too long for the "
        "target's context, go to quarantine.parquet with the reason.",
    )
    def prompts(
        context: dg.AssetExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
        target: dg.ResourceParam[Target],
    ) -> dg.MaterializeResult:
        cfg = project.cfg
        key = context.partition_key
        ds = cfg.dataset(key)
        source = cfg.resolve_path(ds.source)
        guard = target.context_guard()
        with storage.stage(key, "prompts") as layout:
            result = write_prompts(source, layout, ds, guard)
        for q in result.set_aside:
            context.log.warning(f"{key}: set aside {q.describe()}; written again from the source")
        context.log.info(
            f"{key}: {result.outcomes['ok']} prompts from {result.n_source_rows} rows of {source}"
        )
        if result.outcomes["over_context"]:
            context.log.warning(
                f"{key}: {result.outcomes['over_context']} prompts quarantined as longer than the target's "
                f"context of {guard.context:,} tokens ({guard.source})"
            )
        reasons = quarantine_reasons(result.quarantine)
        return dg.MaterializeResult(
            data_version=dg.DataVersion(file_version(layout.prompts)),  # same source rows: same version
            metadata={
                "dagster/row_count": result.prompts.height,
                "source": dg.MetadataValue.path(str(source)),
                "format": ds.format,
                "source_rows": result.n_source_rows,
                "prompts": result.outcomes["ok"],
                "duplicates_dropped": result.outcomes["duplicate"],
                "quarantined": result.outcomes["quarantined"],
                "quarantine_reasons": counts_table(reasons, "reason"),
                # The context every prompt was held to, where it came from, and what it cost: prompts counted
                # with the tokenizer, refused by size alone (never encoded), and whether it was loaded at all.
                "context_length": guard.context,
                "context_length_source": guard.source,
                "over_context": result.outcomes["over_context"],
                "prompts_counted_exactly": guard.counted_exactly,
                "prompts_refused_unencoded": guard.refused_unencoded,
                "tokenizer_loaded": guard.tokenizer_loaded,
                "path": dg.MetadataValue.path(str(layout.prompts)),
                "quarantine_path": dg.MetadataValue.path(str(layout.quarantine)),
                # Damaged earlier outputs moved to quarantine/prompts/ before they were written again.
                "damaged_files_set_aside": len(result.set_aside),
            },
        )

    return prompts


def build_prompts_checks(partitions: dg.PartitionsDefinition) -> list[dg.AssetChecksDefinition]:
    @dg.asset_check(
        asset="prompts",
        name="prompts_not_empty",
        blocking=True,
        partitions_def=partitions,
        description="The partition has at least one prompt. Fails on an empty source, or one whose every row "
        "was quarantined (a wrong format or file, every prompt too long for the target), naming the number "
        "of source rows, how many were quarantined and the top reasons; every later stage would otherwise "
        "pass its checks with nothing in it.",
    )
    def prompts_not_empty(
        context: dg.AssetCheckExecutionContext, storage: dg.ResourceParam[Storage]
    ) -> dg.AssetCheckResult:
        def evaluate(key: str) -> dg.AssetCheckResult:
            layout = storage.checkout(key, "prompts")
            if not layout.prompts.exists():
                return MISSING
            problem = parquet_problem(layout.prompts, PROMPT_SCHEMA, ["id"])
            if problem is not None:
                return dg.AssetCheckResult(passed=False, metadata={"reason": f"prompts.parquet: {problem}"})
            n_prompts = pq.read_metadata(layout.prompts).num_rows
            reasons: list[str] = []
            if layout.quarantine.exists() and parquet_problem(layout.quarantine, QUARANTINE_SCHEMA) is None:
                reasons = pl.read_parquet(layout.quarantine, columns=["reason"])["reason"].to_list()
            return check_result(validation.prompts_present(n_prompts, reasons))

        return check_each_partition(context, evaluate)

    return [prompts_not_empty]
