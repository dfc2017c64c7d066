"""The rules behind the asset checks, as plain functions over the stored tables (testable without Dagster)."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl
import pyarrow.parquet as pq

from ..generation.binding import AnswerRules
from ..generation.conversations import TEMPLATE_REST, split_turn_id, turn_id
from ..generation.identity import TargetIdentity
from ..generation.tool_splice import TOOL_DIVERGED
from ..prompts.ingest import reason_class
from ..target_model.tool_calls import FINISHED_REASONS
from .summary import wilson_interval


@dataclass
class Verdict:
    passed: bool
    metadata: dict[str, Any] = field(default_factory=dict)


def unique_ids(ids: pl.Series) -> Verdict:
    dupes = ids.len() - ids.n_unique()
    return Verdict(dupes == 0, {"rows": ids.len(), "duplicate_ids": dupes})


def answers_from_target(
    models: pl.DataFrame,
    rules: AnswerRules,
    recorded: TargetIdentity | None,
    current: TargetIdentity,
    aside: dict[str, int],
) -> Verdict:
    """Every stored answer (`models`: its backend and served model) was served by a model the config accepts
    as the target, and the partition's answers are recorded as the config's target's."""
    pairs = models.group_by(["backend", "model"]).len().rows() if models.height else []
    foreign = {f"{b}: {m}": n for b, m, n in pairs if rules.foreign(b, m) is not None}
    conflicts = recorded.conflicts(current, backend="") if recorded is not None else []
    return Verdict(
        not foreign and not conflicts,
        {
            "answers": models.height,
            "foreign_answers": sum(foreign.values()),
            "foreign_models": json.dumps(foreign),
            "answers_by_model": json.dumps({f"{b}: {m}": n for b, m, n in pairs}),
            "target_recorded": recorded.name() if recorded is not None else "none recorded",
            "target_configured": current.name(),
            "target_conflicts": "; ".join(conflicts) or "none",
            "answers_set_aside": json.dumps(aside),
        },
    )


def prompts_present(n_prompts: int, reasons: list[str]) -> Verdict:
    """The partition has at least one prompt to send. An empty source, or one whose every row was quarantined
    (a wrong `format` or file, a dataset of over-long prompts), would otherwise pass every later check with
    nothing in it; this fails it, naming how many source rows there were and why they were set aside.
    `reasons`: quarantine.parquet's reasons (every source row is a prompt or one of these)."""
    duplicates = sum(1 for r in reasons if r.startswith("duplicate of "))
    quarantined = len(reasons) - duplicates
    classes = Counter(reason_class(r) for r in reasons if not r.startswith("duplicate of "))
    top = "; ".join(f"{reason} ({n:,})" for reason, n in classes.most_common(5)) or "none"
    metadata: dict[str, Any] = {
        "prompts": n_prompts,
        "source_rows": n_prompts + len(reasons),
        "quarantined": quarantined,
        "duplicates": duplicates,
        "top_reasons": top,
    }
    if n_prompts == 0:
        metadata["reason"] = (
            "no prompts: the source has no rows"
            if not reasons
            else f"no prompts: all {len(reasons):,} source rows were set aside ({quarantined:,} quarantined, "
            f"{duplicates:,} duplicates; top reasons: {top}); check the dataset's source, format and fields"
        )
    return Verdict(n_prompts > 0, metadata)


def failure_share(n_failures: int, n_prompts: int, limit: float, template_rest: int = 0) -> Verdict:
    """Prompts whose last attempt failed, as a share of the prompts. `template_rest`: conversations of
    `turns: all` answered up to a turn the target's template refuses (see `counted_failures`); reported,
    not counted. A partition without prompts fails: a share of nothing is not a pass (`prompts_not_empty`
    says why there are none)."""
    share = n_failures / n_prompts if n_prompts else 0.0
    metadata: dict[str, Any] = {
        "failures": n_failures,
        "prompts": n_prompts,
        "share": share,
        "limit": limit,
        "conversations_cut_by_template": template_rest,
    }
    if n_prompts == 0:
        metadata["reason"] = "no prompts to answer (see the prompts_not_empty check)"
    return Verdict(n_prompts > 0 and share <= limit, metadata)


def counted_failures(failures: pl.DataFrame) -> tuple[int, int]:
    """(failures that count toward the failure share, conversations cut by their template) of a failures table
    (one row per id, its last attempt; `error_kind` column).

    A conversation of `turns: all` whose turn k > 1 the template refuses (roles that do not alternate as it
    demands, say) was regenerated up to that turn and its answers are stored: the rest is data that cannot be
    rendered, not a failed request, so it does not count (bad input: nothing else in the
    partition stops). A prompt whose first turn the template refuses does count: nothing of it was answered,
    exactly as for a request that failed for good, and when many prompts are refused so (a template that
    rejects the dataset's system prompts, a role it does not know) the cause is the choice of template or
    data, which the blocking check must stop before an empty or gutted partition goes downstream; a few such
    prompts stay under checks.max_failure_share like any other lost prompt."""
    if failures.height == 0:
        return 0, 0
    rest = int(failures["error_kind"].is_in([TEMPLATE_REST, TOOL_DIVERGED]).sum())
    return failures.height - rest, rest


def token_rows(path: Path) -> tuple[set[str], set[str] | None]:
    """The ids of a tokens.parquet and those of its conversation rows (`all_turns`), for `token_coverage`;
    None for the latter when the file was written before rows were marked."""
    names = pq.read_schema(path).names
    marked = "all_turns" in names
    rows = pl.read_parquet(path, columns=["id", "all_turns"] if marked else ["id"])
    conversations = set(rows.filter(pl.col("all_turns").fill_null(False))["id"].to_list()) if marked else None
    return set(rows["id"].to_list()), conversations


def token_coverage(
    response_ids: set[str],
    token_ids: set[str],
    error_ids: set[str],
    max_error_share: float,
    conversation_rows: set[str] | None = None,
) -> Verdict:
    """Every answered prompt has a token row or a recorded reason why not (tokens_errors), and the errors stay
    under the threshold: a partition whose every row failed templating must not pass with an empty table.

    `conversation_rows`: the token rows of `turns: all` that train every turn of their conversation
    (tokens.parquet's `all_turns`); such a row `<id>#t<K>` also covers turns 1..K-1. A turn's own row covers
    that turn only, so a per-turn conversation missing an earlier turn's row is caught. None (a caller that
    does not read the mark): every `#t<K>` row is taken to cover its earlier turns, as rows
    written without the mark do."""
    covered = set(token_ids)
    expand = token_ids if conversation_rows is None else token_ids & conversation_rows
    for rid in expand:
        parsed = split_turn_id(rid)
        if parsed is not None:
            covered.update(turn_id(parsed[0], k) for k in range(1, parsed[1]))
    missing = response_ids - covered - error_ids
    n = len(response_ids)
    share = len(error_ids & response_ids) / n if n else 0.0
    metadata: dict[str, Any] = {
        "responses": n,
        "token_rows": len(token_ids),
        "error_rows": len(error_ids),
        "error_share": round(share, 4),
        "max_error_share": max_error_share,
        "without_row_or_reason": len(missing),
        "examples": json.dumps(sorted(missing)[:5]),
    }
    if conversation_rows is not None:
        metadata["conversation_rows"] = len(expand)
    return Verdict(not missing and share <= max_error_share and (bool(token_ids) or n == 0), metadata)


def lengths_match(tokens: pl.DataFrame | pl.LazyFrame) -> Verdict:
    """input_ids and loss_mask must align token for token. (A LazyFrame is reduced to three small columns by
    polars' streaming engine: the token lists of a large partition never sit in memory at once.)"""
    rows = (
        tokens.lazy()
        .select(
            "id",
            (pl.col("input_ids").list.len() != pl.col("loss_mask").list.len()).alias("bad"),
            (pl.col("loss_mask").list.sum() == 0).alias("no_loss"),
        )
        .collect(engine="streaming")
    )
    bad = rows.filter("bad")
    return Verdict(
        bad.height == 0,
        {
            "rows": rows.height,
            "length_mismatches": bad.height,
            "rows_without_trained_tokens": int(rows["no_loss"].sum()),
            "examples": json.dumps(bad["id"].head(5).to_list()),
        },
    )


def end_of_turn_present(tokens: pl.DataFrame | pl.LazyFrame, eot_id: int | None) -> Verdict:
    """A finished answer (finish_reason=stop) ends with the end-of-turn id, and that id is trained."""
    finished = (
        tokens.lazy()
        .filter(pl.col("finish_reason").is_in(FINISHED_REASONS))
        .select(
            "id",
            ((pl.col("input_ids").list.last() != eot_id) | (pl.col("loss_mask").list.last() != 1)).alias(
                "bad"
            ),
        )
        .collect(engine="streaming")
    )
    bad = finished.filter("bad")
    return Verdict(
        eot_id is not None and bad.height == 0,
        {
            "finished_rows": finished.height,
            "missing_end_of_turn": bad.height,
            "end_of_turn_id": eot_id,
            "examples": json.dumps(bad["id"].head(5).to_list()),
        },
    )


def reference_match(tokens: pl.DataFrame, threshold: float) -> Verdict:
    """Rebuilt ids equal the produced ids often enough, beyond sampling noise.

    Differences confined to the cut of a truncated answer are not rebuild errors (the cut text cannot tell
    which ids a cut-off word had); everything else counts. Fails when the 95% interval of the rate lies below
    the threshold, so 1 unlucky row in 28 does not block a dataset while a real defect (wrong template, wrong
    pre-tokenizer) does.
    """
    refs = tokens.filter(pl.col("reference_match").is_not_null())
    if refs.height == 0:
        # Nothing was compared: the check could not run (the caller reports it as UNVERIFIED).
        return Verdict(
            False,
            {
                "verified": False,
                "reference_rows": 0,
                "note": "UNVERIFIED: no reference ids (text-only backend)",
            },
        )
    exact = int(refs["reference_match"].sum())
    explained = int(refs["match_explained"].sum())
    low, high = wilson_interval(explained, refs.height)
    kinds = dict(refs["mismatch"].drop_nulls().value_counts().rows())
    return Verdict(
        high >= threshold,
        {
            "verified": True,
            "exact_rate": exact / refs.height,
            "rate_excluding_truncation_tails": explained / refs.height,
            "threshold": threshold,
            "reference_rows": refs.height,
            "interval_95": f"{low:.4f}-{high:.4f}",
            "mismatch_kinds": json.dumps(kinds),
        },
    )


def answer_quality(report: dict[str, Any], max_truncated: float, max_degenerate: float) -> Verdict:
    passed = report["truncated_share"] <= max_truncated and report["degenerate_share"] <= max_degenerate
    return Verdict(
        passed,
        {
            "truncated_share": report["truncated_share"],
            "max_truncated_share": max_truncated,
            "degenerate_share": report["degenerate_share"],
            "max_degenerate_share": max_degenerate,
            "empty_answers": report["empty_answers"],
        },
    )


def answers_have_text_or_calls(features: pl.DataFrame) -> Verdict:
    """No answer is without text and without calls (`answer_empty` and no reasoning: nothing the draft could
    learn from, stored as if the prompt were answered). Such an answer is retried by the engine, never
    stored; one found here came from elsewhere (an import, an earlier version) and must not be trained."""
    empty = features.filter(
        pl.col("answer_empty").fill_null(False) & ~pl.col("answer_has_reasoning").fill_null(False)
    )
    return Verdict(
        empty.height == 0,
        {
            "answers": features.height,
            "without_text_or_calls": empty.height,
            "examples": ", ".join(empty["id"].head(5).to_list()),
        },
    )


def damaged_files(records: list) -> Verdict:
    """Files a stage found damaged and set aside (`core.storage.quarantine.Quarantined`): passes when there
    are none; otherwise lists each with its reason (a warning: the stage went on without it, rebuilt or asked
    again)."""
    return Verdict(
        not records,
        {
            "damaged_files": len(records),
            "rows_they_held": sum(q.rows or 0 for q in records),
            "files": "\n".join(q.describe() for q in records) or "none",
        },
    )
