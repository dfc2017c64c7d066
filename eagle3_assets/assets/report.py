"""validation_report: per-dataset statistics in report.json / report.md and in the asset's metadata."""

import hashlib
import json

import dagster as dg

from resources import Project, Storage

from ..core.report import render_markdown, write_report
from .common import GROUP


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
        description="Counts, budget use, cost, finish reasons, degenerate answers, token-length distribution and "
        "reference-match rate of one dataset (report.json and a readable report.md).",
    )
    def validation_report(
        context: dg.AssetExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
    ) -> dg.MaterializeResult:
        cfg = project.cfg
        key = context.partition_key
        ds = cfg.dataset(key)
        layout = storage.checkout(key, "validation_report")
        r = write_report(layout, ds.budget_tokens, ds.budget_usd)
        storage.publish(key, "validation_report")
        rate = r["reference_match_rate"]
        content = json.dumps({k: v for k, v in r.items() if k != "generated_at"}, sort_keys=True, default=str)
        return dg.MaterializeResult(
            data_version=dg.DataVersion(hashlib.blake2b(content.encode(), digest_size=8).hexdigest()),
            metadata={
                "summary": dg.MetadataValue.md(render_markdown(r)),
                "n_prompts": r["n_prompts"],
                "n_responses": r["n_responses"],
                "n_failures": r["n_failures"],
                "completion_tokens": r["completion_tokens"],
                "budget_used_share": r["budget_used_share"] or 0.0,
                "cost_usd": r["cost_usd"] if r["cost_usd"] is not None else dg.MetadataValue.null(),
                "truncated_share": r["truncated_share"],
                "degenerate_share": r["degenerate_share"],
                "reference_match_rate": rate if rate is not None else dg.MetadataValue.null(),
                "report_json": dg.MetadataValue.path(str(layout.report_json)),
                "report_md": dg.MetadataValue.path(str(layout.report_md)),
            },
        )

    return validation_report
