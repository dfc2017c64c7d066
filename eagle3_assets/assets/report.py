"""validation_report: per-dataset statistics in report.json / report.md and in the asset's metadata; and its
check."""

import json

import dagster as dg

from resources import Project, Storage

from ..core.report import validation
from ..core.report.summary import render_markdown, write_report
from ..core.storage.versions import content_version
from .common import GROUP, MISSING, check_result


def build_report_asset(
    partitions: dg.PartitionsDefinition, automation_condition: dg.AutomationCondition | None = None
) -> dg.AssetsDefinition:
    @dg.asset(
        name="validation_report",
        deps=["tokens"],
        partitions_def=partitions,
        automation_condition=automation_condition,
        group_name=GROUP,
        kinds={"python", "json"},
        code_version="1",
        description="Counts, budget use, cost, finish reasons, degenerate answers, token-length distribution "
        "and reference-match rate of one dataset (report.json and a readable report.md).",
    )
    def validation_report(
        context: dg.AssetExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
    ) -> dg.MaterializeResult:
        key = context.partition_key
        with storage.stage(key, "validation_report") as layout:
            r = write_report(layout, project.cfg.dataset(key))
        rate = r.reference_match_rate
        content = {k: v for k, v in r.to_json().items() if k != "generated_at"}
        return dg.MaterializeResult(
            data_version=dg.DataVersion(content_version(content)),
            metadata={
                "summary": dg.MetadataValue.md(render_markdown(r)),
                "n_prompts": r.n_prompts,
                "n_responses": r.n_responses,
                "n_failures": r.n_failures,
                "completion_tokens": r.completion_tokens,
                "budget_used_share": r.budget_used_share or 0.0,
                "cost_usd": r.cost_usd if r.cost_usd is not None else dg.MetadataValue.null(),
                "truncated_share": r.truncated_share,
                "degenerate_share": r.degenerate_share,
                "reference_match_rate": rate if rate is not None else dg.MetadataValue.null(),
                "report_json": dg.MetadataValue.path(str(layout.report_json)),
                "report_md": dg.MetadataValue.path(str(layout.report_md)),
            },
        )

    return validation_report


def build_report_checks(partitions: dg.PartitionsDefinition) -> list[dg.AssetChecksDefinition]:
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
        path = storage.checkout(context.partition_key, "validation_report").report_json
        if not path.exists():
            return MISSING
        checks = project.cfg.checks
        verdict = validation.answer_quality(
            json.loads(path.read_text()), checks.max_truncated_share, checks.max_degenerate_share
        )
        return check_result(verdict, warn=True)

    return [report_answer_quality]
