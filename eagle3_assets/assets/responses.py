"""responses: the target model's answers, through whichever inference resource is configured; and its checks.

A backfill of several datasets is one run (`BackfillPolicy.single_run()`): one engine generates all of them at
once inside the key's adaptive window, each within its own budget and journal
(core.generation.run.generate_datasets; the engine module says why one engine and not one run per dataset).
Each partition still gets its own materialisation and metadata (`add_asset_metadata(partition_key=...)`) and
its own check results. Runs of one partition at a time are unchanged; the pool `llm_api` keeps generation to
one step per key.
"""

import time
from collections.abc import Callable
from contextlib import ExitStack

import dagster as dg
import polars as pl

from resources import Inference, Project, Storage, Target

from ..config import ProjectConfig
from ..core.generation.binding import ASKED_AGAIN, AnswerRules
from ..core.generation.identity import TargetIdentity, read_identity
from ..core.generation.journal import ResponseJournal
from ..core.generation.run import DatasetJob, GenerationPlan, GenerationSummary, generate_datasets
from ..core.generation.stopping import watching
from ..core.prompts.ingest import ensure_prompts
from ..core.report import validation
from ..core.storage.layout import DatasetLayout
from ..core.storage.tables import FAILURE_SCHEMA, RESPONSE_SCHEMA, JournalTable
from ..core.storage.versions import content_version, rows_version
from ..core.target_model.pairing import pairing_preflight
from .common import GROUP, check_each_partition, check_result, counts_table, operator_stop


class ResponsesRunConfig(dg.Config):
    """What a launch may choose (the launchpad, a backfill's config). Everything else — endpoints, key
    variables, models, budgets — comes from eagle3.yaml only."""

    limit: int | None = None  # answer at most this many new prompts in this run
    retry_permanent_failures: bool = False  # send prompts again that failed with a permanent error
    max_concurrency: int | None = None  # a lower ceiling for this run (never above the configured one)
    # The config's target is another model than the one the partition's answers came from: set those answers
    # aside (kept in set_aside/, never trained) and answer every prompt afresh. Without it such a run refuses.
    fresh_answers: bool = False


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
        "stop_reason": s.stop_reason + (f" ({s.busy})" if s.busy else ""),
        "completion_tokens_total": s.prior.completion_tokens + (r.completion_tokens if r else 0),
        "lost_in_flight": s.lost_in_flight + s.prior.lost_requests,
        "cost_usd_total": round(s.prior.cost_usd + (r.cost_usd if r else 0.0), 6),
        "run_id": s.run_id,
        # Damaged journal files set aside (quarantine/responses/), and the answers they held, asked again.
        "damaged_files_set_aside": len(s.set_aside.files) if s.set_aside else 0,
        "answers_asked_again": s.set_aside.answers if s.set_aside else 0,
        "set_aside_tokens_charged": round(s.set_aside.charged_tokens) if s.set_aside else 0,
        # Stored answers that no longer answered their prompt as it stands (or came from another model or an
        # earlier target): set aside before anything was sent, their prompts asked again.
        "answers_set_aside_before_sending": counts_table(s.answers_set_aside, "reason"),
        "asked_again": sum(n for k, n in s.answers_set_aside.items() if k in ASKED_AGAIN),
        "answers_restored": s.answers_restored,
        "answers_without_fingerprint": s.answers_unbound,
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
                # The budget charges the larger of the two, answer by answer.
                "completion_tokens_reported_by_provider": r.reported_completion_tokens,
                "completion_tokens_counted_here": r.counted_completion_tokens,
                "answers_cut_at_max_tokens": r.cut_at_max_tokens,
                "answers_from_another_model": r.refused_answers,
                "tokens_per_s": round(r.completion_tokens / r.elapsed_s, 1) if r.elapsed_s else 0.0,
                "mean_in_flight_key": round(r.mean_in_flight, 1),
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


def startup_timeline(
    context: dg.AssetExecutionContext, step_started: float, first_request: float | None
) -> dict:
    """Seconds from the launch to the first request, by phase: the backfill daemon's pickup (when the run came
    from a backfill), the run's start, the step's start, and the step's own preparation (journals, the
    target's and the backend's preflight, the tokenizer where the backend needs one). Wall-clock stamps from
    the instance and this process."""
    record = context.instance.get_run_record_by_id(context.run.run_id)
    phases: dict[str, float] = {}
    created = record.create_timestamp.timestamp() if record else None
    backfill_id = context.run.tags.get("dagster/backfill")
    if backfill_id and created is not None:
        backfill = context.instance.get_backfill(backfill_id)
        if backfill is not None:
            phases["backfill_to_run_created_s"] = created - backfill.backfill_timestamp
    if record is not None and record.start_time is not None and created is not None:
        phases["run_created_to_started_s"] = record.start_time - created
        phases["run_started_to_step_s"] = step_started - record.start_time
    if first_request is not None:
        phases["step_to_first_request_s"] = first_request - step_started
        phases["launch_to_first_request_s"] = sum(phases.values())
    return {k: round(v, 2) for k, v in phases.items()}


def _preflight(cfg: ProjectConfig, target: Target, warn: Callable[[str], None]) -> list[str]:
    """What stops the run before a request is sent: the target's files, then whether tokenizer and model
    belong together (a passed comparison is remembered)."""
    problems = list(target.problems())
    if not problems:
        pairing = pairing_preflight(cfg)
        problems += pairing.problems
        for warning in pairing.warnings:
            warn(warning)
    return problems


def _repair_prompts(
    cfg: ProjectConfig, storage: Storage, keys: list[str], warn: Callable[[str], None]
) -> None:
    """A damaged prompts.parquet is written again from the source, as the prompts stage would: the engine
    reads the prompts of every dataset it answers."""
    for k in keys:
        ds = cfg.dataset(k)
        with storage.stage(k, "prompts") as prompts_layout:
            for q in ensure_prompts(cfg.resolve_path(ds.source), prompts_layout, ds):
                warn(f"{k}: set aside {q.describe()}; written again from the source")


def _dataset_job(
    cfg: ProjectConfig, config: ResponsesRunConfig, storage: Storage, key: str, layout: DatasetLayout
) -> DatasetJob:
    plan = GenerationPlan(
        key=key,
        dataset=cfg.dataset(key),
        sampling=cfg.sampling_for(key),
        retry_permanent_failures=config.retry_permanent_failures,
        limit=config.limit,
        rules=AnswerRules.from_config(cfg, key),
        target=TargetIdentity.from_config(cfg),
        fresh_answers=config.fresh_answers,
    )
    return DatasetJob(layout, plan, storage.lock(key), storage.flusher(key))


def build_responses_asset(
    partitions: dg.PartitionsDefinition,
    automation_condition: dg.AutomationCondition | None = None,
    op_tags: dict | None = None,
) -> dg.AssetsDefinition:
    @dg.asset(
        name="responses",
        deps=["prompts"],
        partitions_def=partitions,
        backfill_policy=dg.BackfillPolicy.single_run(),
        automation_condition=automation_condition,
        group_name=GROUP,
        kinds={"python", "parquet"},
        pool="llm_api",
        op_tags=op_tags,
        code_version="2",
        description="The target model's answer to every prompt (text, reasoning, finish reason, usage, cost "
        "and output token ids where the backend returns them). Resumable: an answered prompt is never sent "
        "again; stops at the dataset's token/dollar budget. A backfill of several datasets is one run that "
        "generates them all at once within the key's limit.",
    )
    def responses(
        context: dg.AssetExecutionContext,
        config: ResponsesRunConfig,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
        inference: dg.ResourceParam[Inference],
        target: dg.ResourceParam[Target],
    ) -> dg.MaterializeResult:
        step_started = time.time()
        cfg = project.cfg
        keys = list(context.partition_keys)
        # Loaded at its first use: a backend that sends text (OpenRouter) may never need it in this step, and
        # a preflight that passed before for these files is remembered (Target.problems).
        chat = target.deferred_chat_tokenizer()
        settings = inference.engine_settings(config.max_concurrency)
        preflight = _preflight(cfg, target, context.log.warning)
        _repair_prompts(cfg, storage, keys, context.log.warning)
        with ExitStack() as stack:
            # Append-only: after a failure too, every answer that was paid for is stored.
            layouts = {k: stack.enter_context(storage.stage(k, "responses", append_only=True)) for k in keys}
            jobs = [_dataset_job(cfg, config, storage, k, layouts[k]) for k in keys]
            with watching(operator_stop(context)):
                summaries = generate_datasets(
                    jobs,
                    inference.create_backend(chat),
                    chat,
                    settings,
                    log=context.log.info,
                    extra_preflight=preflight,
                )
        sent = [s.report.first_dispatch_wall for s in summaries.values() if s.report]
        first = min((t for t in sent if t is not None), default=None)
        timeline = startup_timeline(context, step_started, first)
        versions = {}
        for k in keys:
            stored = JournalTable(layouts[k].responses_dir, RESPONSE_SCHEMA).scan(["id"])
            versions[k] = rows_version(stored, ["id"])  # a run that bought nothing: same version
            md = summary_metadata(summaries[k], settings.max_concurrency)
            md["startup_s"] = dg.MetadataValue.json(timeline)
            md["path"] = dg.MetadataValue.path(str(layouts[k].responses_dir))
            if len(keys) > 1:
                md["datasets_in_this_run"] = ", ".join(keys)
            context.add_asset_metadata(md, partition_key=k)
        # One data version per materialisation: a range run's covers all its partitions, so it changes when
        # any of them changed (the tokens stage re-reads only what is new in each).
        version = versions[keys[0]] if len(keys) == 1 else content_version(versions)
        return dg.MaterializeResult(data_version=dg.DataVersion(version))

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
        def evaluate(key: str) -> dg.AssetCheckResult:
            table = JournalTable(storage.checkout(key, "responses").responses_dir, RESPONSE_SCHEMA)
            return check_result(validation.unique_ids(table.scan(["id"]).collect()["id"]))

        return check_each_partition(context, evaluate)

    @dg.asset_check(
        asset="responses",
        blocking=True,
        partitions_def=partitions,
        description="Share of prompts whose last attempt failed stays under checks.max_failure_share. A "
        "conversation of turns: all cut at a later turn its chat template refuses is answered up to that "
        "turn: reported (conversations_cut_by_template), not counted.",
    )
    def responses_failure_share(
        context: dg.AssetCheckExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
    ) -> dg.AssetCheckResult:
        def evaluate(key: str) -> dg.AssetCheckResult:
            layout = storage.checkout(key, "responses")
            n_prompts = (
                pl.scan_parquet(layout.prompts).select(pl.len()).collect().item()
                if layout.prompts.exists()
                else 0
            )
            failures = JournalTable(layout.failures_dir, FAILURE_SCHEMA).scan(["id", "error_kind"])
            n_fail, cut = validation.counted_failures(
                failures.unique(subset=["id"], keep="last", maintain_order=True).collect()
            )
            limit = project.cfg.checks.max_failure_share
            return check_result(validation.failure_share(n_fail, n_prompts, limit, cut))

        return check_each_partition(context, evaluate)

    @dg.asset_check(
        asset="responses",
        blocking=True,
        partitions_def=partitions,
        description="Every stored answer is the target's own: served by a model the config accepts as the "
        "target, and the partition's answers recorded as the config's target's (target.json). Answers set "
        "aside (edited or removed prompts, another model) are counted, never trained.",
    )
    def responses_from_target(
        context: dg.AssetCheckExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
    ) -> dg.AssetCheckResult:
        def evaluate(key: str) -> dg.AssetCheckResult:
            cfg = project.cfg
            layout = storage.checkout(key, "responses")
            journal = ResponseJournal(layout)
            models = journal.responses.scan(["backend", "model"]).collect()
            return check_result(
                validation.answers_from_target(
                    models,
                    AnswerRules.from_config(cfg, key),
                    read_identity(layout.target_identity),
                    TargetIdentity.from_config(cfg),
                    journal.aside_counts(),
                )
            )

        return check_each_partition(context, evaluate)

    return [responses_unique_ids, responses_failure_share, responses_from_target]
