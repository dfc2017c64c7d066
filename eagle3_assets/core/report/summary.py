"""validation_report: per-dataset statistics read back from the stored outputs (report.json).

Everything is computed from the files on disk, not from what a run remembers, so the report describes the data
a training job will actually read.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from ...config import DatasetConfig
from ..generation.conversations import TEMPLATE_REST, assistant_slots, split_turn_id
from ..generation.identity import read_identity
from ..storage.files import write_json, write_text
from ..storage.layout import DatasetLayout
from ..storage.quarantine import parquet_problem, quarantined
from ..storage.tables import FAILURE_SCHEMA, RESPONSE_SCHEMA, SET_ASIDE_SCHEMA, JournalTable
from ..target_model.tool_calls import FINISHED_REASONS
from .dataset_report import (
    DamagedFile,
    DuplicateIds,
    HistogramBin,
    OutputPaths,
    TurnCounts,
    ValidationReport,
)
from .tool_figures import ToolCallFigures

HIST_BINS = 12
ANSWER_FEATURE_NAMES = ["answer_empty", "answer_degenerate", "answer_has_reasoning"]
RESPONSE_COLUMNS = [
    "id",
    "backend",
    "model",
    "provider",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cost_usd",
    "source",
    "reported_completion_tokens",
    "counted_completion_tokens",
    "quantization",
    "cut_at_max_tokens",
    "tool_calls",
]
TOKEN_COLUMNS = [
    "id",
    "n_tokens",
    "n_loss_tokens",
    "reference_match",
    "match_explained",
    "mismatch",
    "ids_source",
    "finish_reason",
    *ANSWER_FEATURE_NAMES,
]
BAR = "█"


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% confidence interval of a rate; a check on 28 samples must not fail on one unlucky row."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def percentiles(values: np.ndarray) -> dict[str, float]:
    if values.size == 0:
        return {}
    qs = {"min": 0, "p50": 50, "p90": 90, "p99": 99, "max": 100}
    return {k: float(np.percentile(values, q)) for k, q in qs.items()} | {"mean": float(values.mean())}


def histogram(values: np.ndarray, bins: int = HIST_BINS) -> list[HistogramBin]:
    if values.size == 0:
        return []
    lo, hi = float(values.min()), float(values.max())
    edges = np.linspace(lo, hi if hi > lo else lo + 1, bins + 1)
    counts, _ = np.histogram(values, bins=edges)
    return [HistogramBin(float(edges[i]), float(edges[i + 1]), int(c)) for i, c in enumerate(counts)]


def bar_chart(hist: list[HistogramBin], width: int = 40) -> str:
    if not hist:
        return "(no data)"
    top = max(h.count for h in hist) or 1
    lines = []
    for h in hist:
        n = round(width * h.count / top)
        bar = BAR * n if n or not h.count else "▏"
        lines.append(f"{h.start:>8,.0f}-{h.end:<8,.0f} {bar} {h.count}")
    return "\n".join(lines)


def share_chart(counts: dict[str, int], width: int = 30) -> str:
    total = sum(counts.values()) or 1
    return (
        "\n".join(
            f"{k:<16} {BAR * round(width * v / total) or '▏'} {v} ({100 * v / total:.1f}%)"
            for k, v in sorted(counts.items(), key=lambda kv: -kv[1])
        )
        or "(none)"
    )


def _read(path: Path, columns: list[str] | None = None) -> pl.DataFrame | None:
    """The columns of a stage's output; columns an older version did not write come back as nulls. A damaged
    file reads as missing (its own stage sets it aside and rebuilds it; `damaged_files` lists what was set
    aside)."""
    if not path.exists() or parquet_problem(path) is not None:
        return None
    if columns is None:
        return pl.read_parquet(path)
    have = set(pq.read_schema(path).names)
    df = pl.read_parquet(path, columns=[c for c in columns if c in have])
    return df.with_columns(pl.lit(None).alias(c) for c in columns if c not in have)


@dataclass(frozen=True)
class StoredTables:
    """The stage outputs the report reads: small columns only (the answers' text was read once, when each row
    was tokenized: its features are in the token rows and the error rows), so a top-up's report does not
    read every answer again."""

    prompts: pl.DataFrame | None
    quarantine: pl.DataFrame | None
    responses_all: pl.DataFrame  # every response row, duplicates included
    failures: pl.DataFrame
    tokens: pl.DataFrame | None
    tokens_errors: pl.DataFrame | None
    aside: pl.DataFrame  # answers set aside: one row each, with its reason (never trained, still paid for)

    @classmethod
    def read(cls, layout: DatasetLayout) -> StoredTables:
        responses = JournalTable(layout.responses_dir, RESPONSE_SCHEMA).scan(RESPONSE_COLUMNS).collect()
        aside = (
            JournalTable(layout.set_aside_dir, SET_ASIDE_SCHEMA, key="aside_key")
            .scan(["aside_key", "aside_reason", "completion_tokens", "cost_usd"])
            .unique(subset=["aside_key"], keep="first")
            .collect()
        )
        return cls(
            prompts=_read(layout.prompts, ["id", "tools"]),
            quarantine=_read(layout.quarantine, ["reason"]),
            responses_all=responses,
            failures=JournalTable(layout.failures_dir, FAILURE_SCHEMA).read(keep="last"),
            tokens=_read(layout.tokens, TOKEN_COLUMNS),
            tokens_errors=_read(layout.tokens_errors, ["reason", *ANSWER_FEATURE_NAMES]),
            aside=aside,
        )

    @property
    def responses(self) -> pl.DataFrame:
        """One row per id (the first stored)."""
        return self.responses_all.unique(subset=["id"], keep="first", maintain_order=True)


@dataclass(frozen=True)
class AnswerFeatures:
    """How many answers are empty, degenerate or carry reasoning (text features the tokens stage records)."""

    empty: int = 0
    degenerate: int = 0
    with_reasoning: int = 0

    @classmethod
    def of(cls, tables: StoredTables) -> AnswerFeatures:
        parts = [
            t.select(ANSWER_FEATURE_NAMES) for t in (tables.tokens, tables.tokens_errors) if t is not None
        ]
        parts = [t for t in parts if t.height]
        if not parts:
            return cls()
        features = pl.concat(parts, how="vertical_relaxed")
        count = lambda name: int(features[name].fill_null(False).sum())  # noqa: E731
        return cls(count("answer_empty"), count("answer_degenerate"), count("answer_has_reasoning"))


@dataclass
class TokenFigures:
    """What the token rows say: lengths, trained tokens, and how many match the ids the generator produced."""

    token_lengths: dict[str, float] = field(default_factory=dict)
    histogram: list[HistogramBin] = field(default_factory=list)
    loss_tokens: int | None = None
    n_reference: int = 0
    reference_match_rate: float | None = None
    excluding_truncation_tails: float | None = None
    finished_rate: float | None = None
    n_finished: int | None = None
    mismatch_kinds: dict[str, int] = field(default_factory=dict)
    ids_source: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, tokens: pl.DataFrame | None) -> TokenFigures:
        if tokens is None or not tokens.height:
            return cls()
        lengths = tokens["n_tokens"].to_numpy()
        out = cls(
            token_lengths=percentiles(lengths),
            histogram=histogram(lengths),
            loss_tokens=int(tokens["n_loss_tokens"].sum()),
            mismatch_kinds=dict(Counter(m for m in tokens["mismatch"].to_list() if m).most_common()),
            ids_source=dict(Counter(tokens["ids_source"].to_list()).most_common()),
        )
        with_ref = tokens.filter(pl.col("reference_match").is_not_null())
        out.n_reference = with_ref.height
        if with_ref.height:
            out.reference_match_rate = _true_share(with_ref["reference_match"])
            out.excluding_truncation_tails = _true_share(with_ref["match_explained"])
            finished = with_ref.filter(pl.col("finish_reason").is_in(FINISHED_REASONS))
            out.finished_rate = _true_share(finished["reference_match"]) if finished.height else None
            out.n_finished = finished.height
        return out


def build_report(layout: DatasetLayout, dataset: DatasetConfig) -> ValidationReport:
    tables = StoredTables.read(layout)
    responses, failures, tokens = tables.responses, tables.failures, tables.tokens
    n_prompts = tables.prompts.height if tables.prompts is not None else 0
    finish = Counter(responses["finish_reason"].fill_null("unknown").to_list())
    n_resp = responses.height
    answers = AnswerFeatures.of(tables)
    turns = _turn_counts(layout, responses["id"].to_list(), failures) if dataset.turns == "all" else None
    completion_tokens = int(responses["completion_tokens"].fill_null(0).sum())
    aside_tokens = int(tables.aside["completion_tokens"].fill_null(0).sum())
    costs = pl.concat([responses["cost_usd"], tables.aside["cost_usd"]]).drop_nulls()
    tok = TokenFigures.of(tokens)
    charged = responses["completion_tokens"].fill_null(0)
    tools = ToolCallFigures.of(responses.select("id", "tool_calls"), tables.prompts, failures)
    return ValidationReport(
        dataset=layout.key,
        generated_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        n_prompts=n_prompts,
        n_quarantined=tables.quarantine.height if tables.quarantine is not None else 0,
        n_responses=n_resp,
        n_failures=failures.height,
        failure_kinds=dict(Counter(failures["error_kind"].to_list()).most_common()),
        coverage=_share(n_resp, turns.total if turns else n_prompts),
        turns=turns,
        budget_tokens=dataset.budget_tokens,
        budget_usd=dataset.budget_usd,
        completion_tokens=completion_tokens,
        prompt_tokens=int(responses["prompt_tokens"].fill_null(0).sum()),
        budget_used_share=(completion_tokens + aside_tokens) / dataset.budget_tokens
        if dataset.budget_tokens
        else None,
        cost_usd=float(costs.sum()) if costs.len() else None,
        backends=_counts(responses["backend"].to_list()),
        models=_counts(responses["model"].to_list()),
        providers=_counts(p for p in responses["provider"].to_list() if p),
        sources=_counts(responses["source"].fill_null("generated").to_list()),
        finish_reasons=dict(finish.most_common()),
        truncated_share=_share(finish.get("length", 0), n_resp),
        empty_answers=answers.empty,
        degenerate_answers=answers.degenerate,
        degenerate_share=_share(answers.degenerate, n_resp),
        reasoning_share=_share(answers.with_reasoning, n_resp),
        responses_with_output_ids=int(tokens["reference_match"].is_not_null().sum())
        if tokens is not None
        else 0,
        duplicate_ids=DuplicateIds(
            responses_files=tables.responses_all.height - n_resp,
            tokens=(tokens.height - tokens["id"].n_unique()) if tokens is not None else 0,
        ),
        n_tokens_rows=tokens.height if tokens is not None else 0,
        n_tokens_errors=tables.tokens_errors.height if tables.tokens_errors is not None else 0,
        reference_match_rate=tok.reference_match_rate,
        n_reference=tok.n_reference,
        mismatch_kinds=tok.mismatch_kinds,
        token_lengths=tok.token_lengths,
        token_length_histogram=tok.histogram,
        completion_token_lengths=percentiles(responses["completion_tokens"].drop_nulls().to_numpy()),
        damaged_files=[
            DamagedFile(q.path, q.stage, q.reason, q.rows, q.moved_to) for q in quarantined(layout.dir)
        ],
        outputs=OutputPaths(str(layout.dir), str(layout.tokens), str(layout.responses_dir)),
        loss_tokens=tok.loss_tokens,
        reference_match_rate_excluding_truncation_tails=tok.excluding_truncation_tails,
        reference_match_rate_finished=tok.finished_rate,
        n_reference_finished=tok.n_finished,
        ids_source=tok.ids_source,
        completion_tokens_reported=int(responses["reported_completion_tokens"].fill_null(charged).sum()),
        completion_tokens_counted=int(responses["counted_completion_tokens"].fill_null(charged).sum()),
        answers_cut_at_max_tokens=int(responses["cut_at_max_tokens"].fill_null(False).sum()),
        answers_by_model_and_provider=_counts(
            f"{m} via {p or b}" for m, p, b in responses.select("model", "provider", "backend").iter_rows()
        ),
        quantizations=_counts(q for q in responses["quantization"].to_list() if q),
        answers_set_aside=_counts(tables.aside["aside_reason"].to_list()),
        completion_tokens_set_aside=aside_tokens,
        target=_target_name(layout),
        tool_calls=tools if tools.answers_with_calls or tools.conversations_stopped_at_divergence else None,
    )


def _target_name(layout: DatasetLayout) -> str | None:
    """The target the partition's answers are recorded as (`generation.identity`)."""
    recorded = read_identity(layout.target_identity)
    return recorded.name() if recorded is not None else None


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def _counts(values: Iterable[Any]) -> dict[Any, int]:
    """Value -> count, the most frequent first (as report.json lists them)."""
    return dict(Counter(values).most_common())


def _turn_counts(layout: DatasetLayout, response_ids: list[str], failures: pl.DataFrame) -> TurnCounts:
    """turns: all: how many turns the conversations have, how many are answered, in how many conversations."""
    prompts = _read(layout.prompts, ["id", "messages"])
    n_slots = (
        {
            i: len(assistant_slots(m))
            for i, m in zip(prompts["id"], prompts["messages"].to_list(), strict=True)
        }
        if prompts is not None
        else {}
    )
    per_conv: Counter = Counter(p[0] for rid in response_ids if (p := split_turn_id(rid)) and p[0] in n_slots)
    return TurnCounts(
        total=sum(n_slots.values()),
        answered=sum(per_conv.values()),
        conversations_answered=len(per_conv),
        conversations_complete=sum(1 for c, n in per_conv.items() if n >= n_slots[c]),
        conversations_cut_by_template=int((failures["error_kind"] == TEMPLATE_REST).sum()),
    )


def render_markdown(r: ValidationReport) -> str:
    lines = [
        f"# Dataset {r.dataset}",
        "",
        *_empty_notice(r),
        "| measure | value |",
        "| --- | --- |",
        *_measure_rows(r),
        "",
        "## Token lengths (prompt + answer)",
        "",
        "```",
        bar_chart(r.token_length_histogram),
        "```",
        "",
        "percentiles: " + ", ".join(f"{k} {v:,.0f}" for k, v in r.token_lengths.items()),
        "",
        "## Finish reasons",
        "",
        "```",
        share_chart(r.finish_reasons),
        "```",
        "",
        "## Backends",
        "",
        "```",
        share_chart(r.backends),
        "```",
    ]
    if r.mismatch_kinds:
        lines += ["", "## Reference mismatches", "", "```", share_chart(r.mismatch_kinds), "```"]
    if r.damaged_files:
        lines += ["", "## Damaged files set aside", "", "| file | stage | reason | rows held | now at |"]
        lines += ["| --- | --- | --- | --- | --- |"]
        lines += [
            f"| {d.path} | {d.stage} | {d.reason} | {d.rows if d.rows is not None else '?'} | {d.moved_to} |"
            for d in r.damaged_files
        ]
    return "\n".join(lines) + "\n"


def _tool_rows(t: ToolCallFigures | None) -> list[str]:
    """An agentic dataset's calls: how many answers call, how many calls, which look wrong."""
    if t is None:
        return []
    per = f"{t.calls_per_answer_with_calls:.2f}" if t.calls_per_answer_with_calls is not None else "-"
    return [
        f"| answers with tool calls | {t.answers_with_calls:,} ({100 * t.calls_share:.1f}%), "
        f"{t.calls:,} calls, {per} per calling answer |",
        f"| calls with arguments not a JSON object / to tools not offered | {t.arguments_not_json:,} / "
        f"{t.calls_to_tools_not_offered:,} |",
        f"| conversations stopped where the target called other tools than the trace | "
        f"{t.conversations_stopped_at_divergence:,} |",
    ]


def _empty_notice(r: ValidationReport) -> list[str]:
    """A partition without prompts says so first: every figure after it describes nothing, and a reader of an
    all-zero table should not have to infer that."""
    if r.n_prompts:
        return []
    why = (
        f"all {r.n_quarantined:,} source rows were set aside (see quarantine.parquet)"
        if r.n_quarantined
        else "the source has no rows"
    )
    return [f"**0 prompts: {why}. Nothing was asked or trained; the check `prompts_not_empty` fails.**", ""]


def _measure_rows(r: ValidationReport) -> list[str]:
    """The rows of the report's table of measures."""
    cost = f"${r.cost_usd:,.4f}" if r.cost_usd is not None else "n/a"
    share = r.budget_used_share
    return [
        f"| prompts | {r.n_prompts:,} ({r.n_quarantined} quarantined source rows) |",
        f"| responses | {r.n_responses:,} ({100 * r.coverage:.1f}% of "
        + ("turns" if r.turns else "prompts")
        + ") |",
        *([_turns_row(r.turns)] if r.turns else []),
        *_tool_rows(r.tool_calls),
        f"| failures | {r.n_failures:,} {r.failure_kinds or ''} |",
        f"| completion tokens | {r.completion_tokens:,} of budget {r.budget_tokens:,}"
        + (f" ({100 * share:.2f}%)" if share is not None else "")
        + " |",
        f"| completion tokens reported by providers / counted here | {r.completion_tokens_reported:,} / "
        f"{r.completion_tokens_counted:,} (the larger is charged) |",
        f"| cost | {cost} |",
        f"| target | {r.target or 'not recorded'} |",
        f"| answers by model | {r.answers_by_model_and_provider or '-'} |",
        f"| answers set aside (kept, never trained) | {r.answers_set_aside or 'none'} |",
        f"| truncated (finish=length) | {100 * r.truncated_share:.1f}% "
        f"({r.answers_cut_at_max_tokens:,} longer than max_tokens, cut here) |",
        f"| empty / degenerate answers | {r.empty_answers} / {r.degenerate_answers} |",
        f"| with reasoning | {100 * r.reasoning_share:.1f}% |",
        f"| token rows / errors | {r.n_tokens_rows:,} / {r.n_tokens_errors} |",
        f"| reference match | {_reference_text(r)} |",
        f"| duplicate ids | {asdict(r.duplicate_ids)} |",
        f"| damaged files set aside | {len(r.damaged_files)} |",
    ]


def _turns_row(t: TurnCounts) -> str:
    cut = t.conversations_cut_by_template
    return (
        f"| turns (every assistant turn regenerated) | {t.answered:,} of {t.total:,} answered, in "
        f"{t.conversations_answered:,} conversations ({t.conversations_complete:,} complete"
        + (f"; {cut:,} cut at a turn the template refuses" if cut else "")
        + ") |"
    )


def _reference_text(r: ValidationReport) -> str:
    rate = r.reference_match_rate
    if rate is None:
        return "n/a (no reference ids)"
    text = f"{100 * rate:.2f}% of {r.n_reference}"
    fin = r.reference_match_rate_finished
    text += f"; finished answers {100 * fin:.2f}% of {r.n_reference_finished}" if fin is not None else ""
    tails = r.reference_match_rate_excluding_truncation_tails
    return text + (f"; excluding truncation tails {100 * tails:.2f}%" if tails is not None else "")


def write_report(layout: DatasetLayout, dataset: DatasetConfig) -> ValidationReport:
    report = build_report(layout, dataset)
    write_json(report.to_json(), layout.report_json)
    write_text(render_markdown(report), layout.report_md)
    return report


def _true_share(flags: pl.Series) -> float:
    """The share of true values among the non-null ones of a boolean column (NaN when all are null)."""
    known = flags.drop_nulls()
    return int(known.cast(pl.Int64).sum()) / known.len() if known.len() else float("nan")
