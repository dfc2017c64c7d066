"""The `quarantined_files` check of each stage that sets damaged files aside (a warning: the stage went
on)."""

import dagster as dg

from resources import Storage

from ..core.report import validation
from ..core.storage.quarantine import QUARANTINE_STAGES, quarantined
from .common import check_each_partition, check_result


def build_quarantine_checks(partitions: dg.PartitionsDefinition) -> list[dg.AssetChecksDefinition]:
    """One per asset whose stage checks its own files and sets damaged ones aside (`quarantine/<stage>/`)."""
    return [_check(stage, partitions) for stage in QUARANTINE_STAGES]


def _check(stage: str, partitions: dg.PartitionsDefinition) -> dg.AssetChecksDefinition:
    @dg.asset_check(
        asset=stage,
        name="quarantined_files",
        blocking=False,
        partitions_def=partitions,
        description=f"No file of the {stage} stage was found damaged (cut short, not Parquet or safetensors, "
        f"wrong schema). Warns, listing each file set aside under quarantine/{stage}/ with its reason; the "
        "stage went on without it (its answers asked again, its table rebuilt, its shard recomputed). "
        "Restore or delete the files there to clear the warning.",
    )
    def quarantined_files(
        context: dg.AssetCheckExecutionContext, storage: dg.ResourceParam[Storage]
    ) -> dg.AssetCheckResult:
        def evaluate(key: str) -> dg.AssetCheckResult:
            layout = storage.checkout(key, "quarantine")
            return check_result(validation.damaged_files(quarantined(layout.dir, stage)), warn=True)

        return check_each_partition(context, evaluate)

    return quarantined_files
