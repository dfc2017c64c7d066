"""tokens: exact input ids and loss masks of every answered conversation; and its checks."""

import dagster as dg
import polars as pl

from resources import Project, Storage, Target

from ..core.generation.binding import AnswerRules
from ..core.generation.journal import ResponseJournal
from ..core.prompts.ingest import ensure_prompts
from ..core.report import validation
from ..core.storage.layout import DatasetLayout
from ..core.storage.versions import rows_version
from ..core.tokens.build import build_tokens
from .common import GROUP, MISSING, check_result, counts_table, refuse_another_targets_answers, scan_tokens


def build_tokens_asset(
    partitions: dg.PartitionsDefinition, automation_condition: dg.AutomationCondition | None = None
) -> dg.AssetsDefinition:
    @dg.asset(
        name="tokens",
        deps=["responses"],
        partitions_def=partitions,
        automation_condition=automation_condition,
        group_name=GROUP,
        kinds={"python", "parquet"},
        code_version="3",
        description="Prompt + answer rendered with the target's chat template and tokenized: input_ids, "
        "loss_mask (1 on the generated tokens incl. end-of-turn), and reference_match against the ids the "
        "model produced.",
    )
    def tokens(
        context: dg.AssetExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
        target: dg.ResourceParam[Target],
    ) -> dg.MaterializeResult:
        cfg = project.cfg
        key = context.partition_key
        chat = target.chat_tokenizer()
        # Proven once for the template, or the reason every row's render is compared with its plan.
        template_check = (
            "proven verbatim once" if chat.verbatim_problem is None else f"every row: {chat.verbatim_problem}"
        )
        context.log.info(f"{key}: template text check: {template_check}")
        # A damaged prompts.parquet (the prompts stage has not run since) is set aside and written again from
        # the source, as the prompts stage would, rather than failing this stage.
        ds = cfg.dataset(key)
        with storage.stage(key, "prompts") as prompts_layout:
            for q in ensure_prompts(cfg.resolve_path(ds.source), prompts_layout, ds):
                context.log.warning(f"{key}: set aside {q.describe()}; written again from the source")
        with storage.stage(key, "tokens") as layout:
            refuse_another_targets_answers(layout, cfg, key)
            # Answers that no longer answer their prompt as it stands are never trained (the responses stage
            # sets them aside and asks again).
            standing = ResponseJournal(layout).standing(AnswerRules.from_config(cfg, key))
            if standing.aside:
                context.log.warning(
                    f"{key}: {len(standing.aside):,} stored answers no longer stand and are not trained "
                    f"({standing.counts()}); materialise responses to set them aside and ask again"
                )
            s = build_tokens(layout, chat, cfg.tokens, log=context.log.info, exclude=standing.aside)
        rate = s.match_rate
        context.log.info(
            f"{key}: {s.n_rows} conversations ({s.n_tokenized:,} new or changed tokenized), {s.n_tokens:,} "
            "tokens; reference match "
            + (f"{100 * rate:.2f}% of {s.n_reference}" if rate is not None else "n/a (no reference ids)")
        )
        return dg.MaterializeResult(
            data_version=dg.DataVersion(rows_version(pl.scan_parquet(layout.tokens), ["id", "row_key"])),
            metadata={
                "dagster/row_count": s.n_rows,
                "tokens": s.n_tokens,
                "loss_tokens": s.n_loss_tokens,
                "errors": s.n_errors,
                "tokenized_this_run": s.n_tokenized,
                "kept_unchanged": s.n_rows + s.n_errors - s.n_tokenized,
                "reference_rows": s.n_reference,
                "reference_match_rate": float(rate) if rate is not None else dg.MetadataValue.null(),
                "mismatch_kinds": counts_table(dict(s.mismatch_kinds), "mismatch"),
                "ids_source": counts_table(dict(s.ids_source), "source"),
                "template_check": template_check,
                "answers_not_trained": counts_table(standing.counts(), "reason"),
                # Damaged earlier outputs moved to quarantine/tokens/ and rebuilt in this run.
                "damaged_files_set_aside": len(s.set_aside),
                "path": dg.MetadataValue.path(str(layout.tokens)),
            },
        )

    return tokens


def _token_coverage(layout: DatasetLayout, rules: AnswerRules, limit: float) -> validation.Verdict:
    """Over the answers that stand: one set aside (or waiting to be) has no token row, by design."""
    journal = ResponseJournal(layout)
    responses = journal.responses.keys() - set(journal.standing(rules).aside)
    tokens, conversations = validation.token_rows(layout.tokens)
    errors = (
        set(pl.read_parquet(layout.tokens_errors, columns=["id"])["id"].to_list())
        if layout.tokens_errors.exists()
        else set()
    )
    return validation.token_coverage(responses, tokens, errors, limit, conversations)


def build_tokens_checks(
    partitions: dg.PartitionsDefinition, reference_ids: bool = True
) -> list[dg.AssetChecksDefinition]:
    """`reference_ids`: the configured backend returns the ids it generated (local, sglang), so the reference
    comparison blocks; a text backend's answers have none to compare (the check then warns, UNVERIFIED)."""

    @dg.asset_check(
        asset="tokens",
        blocking=True,
        partitions_def=partitions,
        description="Every row's input_ids and loss_mask have the same length.",
    )
    def tokens_lengths_match(
        context: dg.AssetCheckExecutionContext, storage: dg.ResourceParam[Storage]
    ) -> dg.AssetCheckResult:
        df = scan_tokens(storage, context.partition_key, ["id", "input_ids", "loss_mask"])
        return MISSING if df is None else check_result(validation.lengths_match(df))

    @dg.asset_check(
        asset="tokens",
        blocking=reference_ids,
        partitions_def=partitions,
        description="Rebuilt ids equal the model's own output ids for at least "
        "checks.min_reference_match_rate of the rows that have them (truncation tails excepted; fails "
        "when the 95% interval of the rate lies below the threshold). With no produced ids to compare "
        "(a text backend) it cannot run: a failed warning marked UNVERIFIED, never a pass.",
    )
    def tokens_reference_match(
        context: dg.AssetCheckExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
    ) -> dg.AssetCheckResult:
        lf = scan_tokens(storage, context.partition_key, ["reference_match", "match_explained", "mismatch"])
        threshold = project.cfg.checks.min_reference_match_rate
        if lf is None:
            return MISSING
        v = validation.reference_match(lf.collect(), threshold)
        if not v.metadata["verified"]:
            # Nothing to compare against: the check could not run, so it does not pass. A warning: in a run
            # nothing downstream stops on it, and with a text backend the check does not block automation
            # either (`reference_ids`), since such a backend never has ids to compare.
            return dg.AssetCheckResult(
                passed=False,
                severity=dg.AssetCheckSeverity.WARN,
                metadata=v.metadata,
                description="UNVERIFIED: the backend returned no token ids (text only), so the rebuilt ids "
                "could not be compared with what the model produced",
            )
        return check_result(v)

    @dg.asset_check(
        asset="tokens",
        blocking=True,
        partitions_def=partitions,
        description="Every answered prompt has a token row or a recorded reason (tokens_errors.parquet), and "
        "the errors stay under checks.max_token_error_share; responses with no token rows at all fail.",
    )
    def tokens_coverage(
        context: dg.AssetCheckExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
    ) -> dg.AssetCheckResult:
        layout = storage.checkout(context.partition_key, "tokens")
        if not layout.tokens.exists():
            return MISSING
        cfg, key = project.cfg, context.partition_key
        return check_result(
            _token_coverage(layout, AnswerRules.from_config(cfg, key), cfg.checks.max_token_error_share)
        )

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
        df = scan_tokens(storage, context.partition_key, ["id", "input_ids", "loss_mask", "finish_reason"])
        eot = target.chat_tokenizer().eot_id
        return MISSING if df is None else check_result(validation.end_of_turn_present(df, eot))

    @dg.asset_check(
        asset="tokens",
        blocking=True,
        partitions_def=partitions,
        description="No answer is without text and without tool calls: a provider's empty answer is retried, "
        "never stored as an answered prompt; one found here (an import, an earlier version) is nothing to "
        "train and must be asked again.",
    )
    def tokens_answers_have_text_or_calls(
        context: dg.AssetCheckExecutionContext, storage: dg.ResourceParam[Storage]
    ) -> dg.AssetCheckResult:
        layout = storage.checkout(context.partition_key, "tokens")
        if not layout.tokens.exists():
            return MISSING
        return check_result(validation.answers_have_text_or_calls(answer_features(layout)))

    return [
        tokens_lengths_match,
        tokens_reference_match,
        tokens_coverage,
        tokens_end_of_turn,
        tokens_answers_have_text_or_calls,
    ]


def answer_features(layout: DatasetLayout) -> pl.DataFrame:
    """id, answer_empty and answer_has_reasoning of every answer the tokens stage saw (rows and errors)."""
    columns = ["id", "answer_empty", "answer_has_reasoning"]
    parts = [pl.read_parquet(p, columns=columns) for p in (layout.tokens, layout.tokens_errors) if p.exists()]
    return pl.concat(parts, how="vertical_relaxed")
