"""tokens: exact input ids and loss masks of every answered conversation."""

import dagster as dg

from resources import Project, Storage, Target

from ..core.tokens import build_tokens
from ..core.versions import rows_version
from .common import GROUP, counts_table


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
        code_version="2",
        description="Prompt + answer rendered with the target's chat template and tokenized: input_ids, loss_mask "
        "(1 on the generated tokens incl. end-of-turn), and reference_match against the ids the model produced.",
    )
    def tokens(
        context: dg.AssetExecutionContext,
        project: dg.ResourceParam[Project],
        storage: dg.ResourceParam[Storage],
        target: dg.ResourceParam[Target],
    ) -> dg.MaterializeResult:
        cfg = project.cfg
        key = context.partition_key
        layout = storage.checkout(key, "tokens")
        chat = target.chat_tokenizer()
        # Proven once for the template, or the reason every row's render is compared with its plan.
        template_check = (
            "proven verbatim once" if chat.verbatim_problem is None else f"every row: {chat.verbatim_problem}"
        )
        context.log.info(f"{key}: template text check: {template_check}")
        s = build_tokens(
            layout,
            chat,
            cfg.tokens.train_all_assistant_turns,
            cfg.tokens.prefer_reference_ids,
            cfg.tokens.batch_size,
            log=context.log.info,
        )
        storage.publish(key, "tokens")
        rate = s.match_rate
        context.log.info(
            f"{key}: {s.n_rows} conversations ({s.n_tokenized:,} new or changed tokenized), {s.n_tokens:,} tokens; "
            "reference match "
            + (f"{100 * rate:.2f}% of {s.n_reference}" if rate is not None else "n/a (no reference ids)")
        )
        import polars as pl

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
                "path": dg.MetadataValue.path(str(layout.tokens)),
            },
        )

    return tokens
