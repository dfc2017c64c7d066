"""responses: the target model's answers, through whichever inference resource is configured; and its checks."""

import dagster as dg
import polars as pl

from resources import Inference, Project, Storage, Target

from ..core.generation.run import GenerationPlan, GenerationSummary, generate_responses
from ..core.report import validation
from ..core.storage.tables import FAILURE_SCHEMA, RESPONSE_SCHEMA, JournalTable
from ..core.storage.versions import rows_version
from .common import GROUP, check_result, counts_table


class ResponsesRunConfig(dg.Config):
    """What a launch may choose (the launchpad, a backfill's config). Everything else — endpoints, key variables,
    models, budgets — comes from eagle3.yaml only."""

    limit: int | None = None  # answer at most this many new prompts in this run
    retry_permanent_failures: bool = False  # send prompts again that failed with a permanent error
    max_concurrency: int | None = None  # a lower ceiling for this run (never above the configured one)


def summary_metadata(s: GenerationSummary, max_concurrency: int | None) -> dict:
    r = s.report
    md: dict = {
        "dagster/row_count": s.n_responses,
        "backend": s.backend,
        "prompts": s.n_prompts,
        "answered_total": s.n_responses,
        "answered_before_this_run": s.already_done,
        "sent_this_run": r.sent if r else 0,
        "failures_total": s.n_failures,
        "skipped_permanent_failures": s.skipped_permanent,
        "stop_reason": s.stop_reason,
        "completion_tokens_total": s.prior.completion_tokens + (r.completion_tokens if r else 0),
        "lost_in_flight": s.lost_in_flight + s.prior.lost_requests,
        "cost_usd_total": round(s.prior.cost_usd + (r.cost_usd if r else 0.0), 6),
        "run_id": s.run_id,
    }
    if r:
        md.update(
            {
                "completion_tokens_this_run": r.completion_tokens,
                "cost_usd_this_run": round(r.cost_usd, 6),
                "goodput_answers_per_s": round(r.goodput_rps, 2),
                "refused_share": round(r.refused_share, 4),
                "refused_attempts": r.refused,
                "concurrency_limit": dg.MetadataValue.json(
                    {
                        "final": r.limit_final,
                        "min": r.limit_min,
                        "max": r.limit_max,
                        "ceiling": max_concurrency,
                        "decreases": r.limit_decreases,
                        "key_wide_pauses": r.global_pauses,
                        "max_in_flight": r.max_in_flight,
                    }
                ),
                "unanswered_after_backpressure": r.unanswered,
                "usage_counted_locally": r.usage_estimated,
                "tokens_per_s": round(r.completion_tokens / r.elapsed_s, 1) if r.elapsed_s else 0.0,
                "elapsed_s": round(r.elapsed_s, 1),
                "attempts": r.attempts,
                "providers": counts_table(dict(r.providers.most_common()), "provider"),
                "finish_reasons": counts_table(dict(r.finish_reasons.most_common()), "finish_reason"),
                "errors_by_kind": counts_table(dict(r.errors.most_common()), "error_kind"),
                "failure_kinds": counts_table(dict(r.failure_kinds.most_common()), "error_kind"),
                "latency_s": dg.MetadataValue.json(
                    {k: round(v, 3) for k, v in r.latency_percentiles().items()}
                ),
            }
        )
    return md


def build_responses_asset(
    partitions: dg.PartitionsDefinition,
    automation_condition: dg.AutomationCondition | None = None,
    op_tags: dict | None = None,
) -> dg.AssetsDefinition:
    @dg.asset(
        name="responses",
        deps=["prompts"],
        partitions_def=partitions,
        automation_condition=automation_condition,
        group_name=GROUP,
        kinds={"python", "parquet"},
        pool="llm_api",
        op_tags=op_tags,
        code_version="2",
        description="The target model's answer to every prompt (text, reasoning, finish reason, usage, cost and "
        "output token ids where the backend returns them). Resumable: an answered prompt is never sent again; "
        "stops at the dataset's token/dollar budget.",
    )
    def responses(
        context: dg.AssetExecutionContext,
        config: ResponsesRunConfig,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
        inference: dg.ResourceParam[Inference],
        target: dg.ResourceParam[Target],
    ) -> dg.MaterializeResult:
        cfg = project.cfg
        key = context.partition_key
        plan = GenerationPlan(
            key=key,
            dataset=cfg.dataset(key),
            sampling=cfg.sampling_for(key),
            retry_permanent_failures=config.retry_permanent_failures,
            limit=config.limit,
        )
        chat = target.chat_tokenizer()
        settings = inference.engine_settings(config.max_concurrency)
        # Append-only: after a failure too, every answer that was paid for is stored.
        with storage.stage(key, "responses", append_only=True) as layout:
            summary = generate_responses(
                layout,
                plan,
                inference.create_backend(chat),
                chat,
                settings,
                log=context.log.info,
                extra_preflight=target.problems(),
                lock=storage.lock(key),
                on_flush=storage.flusher(key),
            )
        stored = JournalTable(layout.responses_dir, RESPONSE_SCHEMA).scan(["id"])
        return dg.MaterializeResult(
            data_version=dg.DataVersion(
                rows_version(stored, ["id"])
            ),  # a run that bought nothing: same version
            metadata=summary_metadata(summary, settings.max_concurrency)
            | {"path": dg.MetadataValue.path(str(layout.responses_dir))},
        )

    return responses


def build_responses_checks(partitions: dg.PartitionsDefinition) -> list[dg.AssetChecksDefinition]:
    @dg.asset_check(
        asset="responses",
        blocking=True,
        partitions_def=partitions,
        description="No prompt id has two stored responses.",
    )
    def responses_unique_ids(
        context: dg.AssetCheckExecutionContext, storage: dg.ResourceParam[Storage]
    ) -> dg.AssetCheckResult:
        table = JournalTable(
            storage.checkout(context.partition_key, "responses").responses_dir, RESPONSE_SCHEMA
        )
        return check_result(validation.unique_ids(table.scan(["id"]).collect()["id"]))

    @dg.asset_check(
        asset="responses",
        blocking=True,
        partitions_def=partitions,
        description="Share of prompts whose last attempt failed stays under checks.max_failure_share.",
    )
    def responses_failure_share(
        context: dg.AssetCheckExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
    ) -> dg.AssetCheckResult:
        layout = storage.checkout(context.partition_key, "responses")
        n_prompts = (
            pl.scan_parquet(layout.prompts).select(pl.len()).collect().item()
            if layout.prompts.exists()
            else 0
        )
        n_fail = len(JournalTable(layout.failures_dir, FAILURE_SCHEMA).keys())
        return check_result(validation.failure_share(n_fail, n_prompts, project.cfg.checks.max_failure_share))

    return [responses_unique_ids, responses_failure_share]
