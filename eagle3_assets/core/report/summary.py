"""validation_report: per-dataset statistics read back from the stored outputs (report.json).

Everything is computed from the files on disk, not from what a run remembers, so the report describes the data a
training job will actually read.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow.parquet as pq

from ...config import DatasetConfig
from ..generation.conversations import TEMPLATE_REST, assistant_slots, split_turn_id
from ..storage.files import write_json, write_text
from ..storage.layout import DatasetLayout
from ..storage.quarantine import parquet_problem, quarantined
from ..storage.tables import FAILURE_SCHEMA, RESPONSE_SCHEMA, JournalTable

HIST_BINS = 12
ANSWER_FEATURE_NAMES = ["answer_empty", "answer_degenerate", "answer_has_reasoning"]
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


def histogram(values: np.ndarray, bins: int = HIST_BINS) -> list[dict[str, float]]:
    if values.size == 0:
        return []
    lo, hi = float(values.min()), float(values.max())
    edges = np.linspace(lo, hi if hi > lo else lo + 1, bins + 1)
    counts, _ = np.histogram(values, bins=edges)
    return [
        {"from": float(edges[i]), "to": float(edges[i + 1]), "count": int(c)} for i, c in enumerate(counts)
    ]


def bar_chart(hist: list[dict[str, float]], width: int = 40) -> str:
    if not hist:
        return "(no data)"
    top = max(h["count"] for h in hist) or 1
    lines = []
    for h in hist:
        n = round(width * h["count"] / top)
        bar = BAR * n if n or not h["count"] else "▏"
        lines.append(f"{h['from']:>8,.0f}-{h['to']:<8,.0f} {bar} {h['count']}")
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
    """The columns of a stage's output; columns an older version did not write come back as nulls. A damaged file
    reads as missing (its own stage sets it aside and rebuilds it; `damaged_files` lists what was set aside)."""
    if not path.exists() or parquet_problem(path) is not None:
        return None
    if columns is None:
        return pl.read_parquet(path)
    have = set(pq.read_schema(path).names)
    df = pl.read_parquet(path, columns=[c for c in columns if c in have])
    return df.with_columns(pl.lit(None).alias(c) for c in columns if c not in have)


def build_report(layout: DatasetLayout, dataset: DatasetConfig) -> dict[str, Any]:
    budget_tokens, budget_usd = dataset.budget_tokens, dataset.budget_usd
    prompts = _read(layout.prompts, ["id"])
    quarantine = _read(layout.quarantine, ["reason"])
    # Small columns only: the answers' text was read once, when each row was tokenized (its features are in the
    # token rows and the error rows), so a top-up's report does not read every answer again.
    responses_all = (
        JournalTable(layout.responses_dir, RESPONSE_SCHEMA)
        .scan(
            [
                "id",
                "backend",
                "model",
                "provider",
                "finish_reason",
                "prompt_tokens",
                "completion_tokens",
                "cost_usd",
                "source",
            ]
        )
        .collect()
    )
    failures = JournalTable(layout.failures_dir, FAILURE_SCHEMA).read(keep="last")
    tokens = _read(
        layout.tokens,
        [
            "id",
            "n_tokens",
            "n_loss_tokens",
            "reference_match",
            "match_explained",
            "mismatch",
            "ids_source",
            "finish_reason",
            *ANSWER_FEATURE_NAMES,
        ],
    )
    tokens_errors = _read(layout.tokens_errors, ["reason", *ANSWER_FEATURE_NAMES])

    responses = responses_all.unique(subset=["id"], keep="first", maintain_order=True)
    n_prompts = prompts.height if prompts is not None else 0
    finish = Counter(responses["finish_reason"].fill_null("unknown").to_list())
    n_resp = responses.height
    features = (
        pl.concat(
            [t.select(ANSWER_FEATURE_NAMES) for t in (tokens, tokens_errors) if t is not None and t.height],
            how="vertical_relaxed",
        )
        if any(t is not None and t.height for t in (tokens, tokens_errors))
        else None
    )
    count = lambda name: int(features[name].fill_null(False).sum()) if features is not None else 0  # noqa: E731
    empty, degenerate, with_reasoning = (
        count("answer_empty"),
        count("answer_degenerate"),
        count("answer_has_reasoning"),
    )
    turns = _turn_counts(layout, responses["id"].to_list()) if dataset.turns == "all" else None
    if turns is not None:
        # Answered up to a turn the template refuses: the rest is recorded (failures, kind template_rest) and not
        # counted as failed requests by the failure-share check.
        turns["conversations_cut_by_template"] = int((failures["error_kind"] == TEMPLATE_REST).sum())
    completion_tokens = int(responses["completion_tokens"].fill_null(0).sum())
    costs = responses["cost_usd"].drop_nulls()
    cost = float(costs.sum()) if costs.len() else None

    report: dict[str, Any] = {
        "dataset": layout.key,
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "n_prompts": n_prompts,
        "n_quarantined": quarantine.height if quarantine is not None else 0,
        "n_responses": n_resp,
        "n_failures": failures.height,
        "failure_kinds": dict(Counter(failures["error_kind"].to_list()).most_common()),
        # turns: all: answered turns over the conversations' turns (a response row is a turn)
        "coverage": (n_resp / turns["total"] if turns["total"] else 0.0)
        if turns
        else (n_resp / n_prompts if n_prompts else 0.0),
        "turns": turns,
        "budget_tokens": budget_tokens,
        "budget_usd": budget_usd,
        "completion_tokens": completion_tokens,
        "prompt_tokens": int(responses["prompt_tokens"].fill_null(0).sum()),
        "budget_used_share": completion_tokens / budget_tokens if budget_tokens else None,
        "cost_usd": cost,
        "backends": dict(Counter(responses["backend"].to_list()).most_common()),
        "models": dict(Counter(responses["model"].to_list()).most_common()),
        "providers": dict(Counter(p for p in responses["provider"].to_list() if p).most_common()),
        "sources": dict(Counter(responses["source"].fill_null("generated").to_list()).most_common()),
        "finish_reasons": dict(finish.most_common()),
        "truncated_share": finish.get("length", 0) / n_resp if n_resp else 0.0,
        "empty_answers": empty,
        "degenerate_answers": degenerate,
        "degenerate_share": degenerate / n_resp if n_resp else 0.0,
        "reasoning_share": with_reasoning / n_resp if n_resp else 0.0,
        "responses_with_output_ids": int(tokens["reference_match"].is_not_null().sum())
        if tokens is not None
        else 0,
        "duplicate_ids": {
            "responses_files": responses_all.height - n_resp,
            "tokens": (tokens.height - tokens["id"].n_unique()) if tokens is not None else 0,
        },
        "n_tokens_rows": tokens.height if tokens is not None else 0,
        "n_tokens_errors": tokens_errors.height if tokens_errors is not None else 0,
        "reference_match_rate": None,
        "n_reference": 0,
        "mismatch_kinds": {},
        "token_lengths": {},
        "token_length_histogram": [],
        "completion_token_lengths": percentiles(responses["completion_tokens"].drop_nulls().to_numpy()),
        # Files a stage found damaged and set aside (quarantine/<stage>/), each with where it was and why.
        "damaged_files": [
            {"path": q.path, "stage": q.stage, "reason": q.reason, "rows": q.rows, "moved_to": q.moved_to}
            for q in quarantined(layout.dir)
        ],
        "outputs": {
            "dir": str(layout.dir),
            "tokens": str(layout.tokens),
            "responses": str(layout.responses_dir),
        },
    }
    if tokens is not None and tokens.height:
        lengths = tokens["n_tokens"].to_numpy()
        report["token_lengths"] = percentiles(lengths)
        report["token_length_histogram"] = histogram(lengths)
        report["loss_tokens"] = int(tokens["n_loss_tokens"].sum())
        with_ref = tokens.filter(pl.col("reference_match").is_not_null())
        report["n_reference"] = with_ref.height
        if with_ref.height:
            report["reference_match_rate"] = float(with_ref["reference_match"].mean())
            report["reference_match_rate_excluding_truncation_tails"] = float(
                with_ref["match_explained"].mean()
            )
            finished = with_ref.filter(pl.col("finish_reason") == "stop")
            report["reference_match_rate_finished"] = (
                float(finished["reference_match"].mean()) if finished.height else None
            )
            report["n_reference_finished"] = finished.height
        report["mismatch_kinds"] = dict(Counter(m for m in tokens["mismatch"].to_list() if m).most_common())
        report["ids_source"] = dict(Counter(tokens["ids_source"].to_list()).most_common())
    return report


def _turn_counts(layout: DatasetLayout, response_ids: list[str]) -> dict[str, int]:
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
    return {
        "total": sum(n_slots.values()),
        "answered": sum(per_conv.values()),
        "conversations_answered": len(per_conv),
        "conversations_complete": sum(1 for c, n in per_conv.items() if n >= n_slots[c]),
    }


def render_markdown(r: dict[str, Any]) -> str:
    rate = r["reference_match_rate"]
    rate_text = f"{100 * rate:.2f}% of {r['n_reference']}" if rate is not None else "n/a (no reference ids)"
    if rate is not None:
        fin = r.get("reference_match_rate_finished")
        rate_text += (
            f"; finished answers {100 * fin:.2f}% of {r['n_reference_finished']}" if fin is not None else ""
        )
        rate_text += (
            f"; excluding truncation tails {100 * r['reference_match_rate_excluding_truncation_tails']:.2f}%"
        )
    cost = f"${r['cost_usd']:,.4f}" if r["cost_usd"] is not None else "n/a"
    budget_share = r["budget_used_share"]
    lines = [
        f"# Dataset {r['dataset']}",
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| prompts | {r['n_prompts']:,} ({r['n_quarantined']} quarantined source rows) |",
        f"| responses | {r['n_responses']:,} ({100 * r['coverage']:.1f}% of "
        + ("turns" if r.get("turns") else "prompts")
        + ") |",
        *(
            [
                f"| turns (every assistant turn regenerated) | {t['answered']:,} of {t['total']:,} answered, in "
                f"{t['conversations_answered']:,} conversations ({t['conversations_complete']:,} complete"
                + (
                    f"; {cut:,} cut at a turn the template refuses"
                    if (cut := t.get("conversations_cut_by_template"))
                    else ""
                )
                + ") |"
            ]
            if (t := r.get("turns"))
            else []
        ),
        f"| failures | {r['n_failures']:,} {r['failure_kinds'] or ''} |",
        f"| completion tokens | {r['completion_tokens']:,} of budget {r['budget_tokens']:,}"
        + (f" ({100 * budget_share:.2f}%)" if budget_share is not None else "")
        + " |",
        f"| cost | {cost} |",
        f"| truncated (finish=length) | {100 * r['truncated_share']:.1f}% |",
        f"| empty / degenerate answers | {r['empty_answers']} / {r['degenerate_answers']} |",
        f"| with reasoning | {100 * r['reasoning_share']:.1f}% |",
        f"| token rows / errors | {r['n_tokens_rows']:,} / {r['n_tokens_errors']} |",
        f"| reference match | {rate_text} |",
        f"| duplicate ids | {r['duplicate_ids']} |",
        f"| damaged files set aside | {len(r.get('damaged_files') or [])} |",
        "",
        "## Token lengths (prompt + answer)",
        "",
        "```",
        bar_chart(r["token_length_histogram"]),
        "```",
        "",
        "percentiles: " + ", ".join(f"{k} {v:,.0f}" for k, v in r["token_lengths"].items()),
        "",
        "## Finish reasons",
        "",
        "```",
        share_chart(r["finish_reasons"]),
        "```",
        "",
        "## Backends",
        "",
        "```",
        share_chart(r["backends"]),
        "```",
    ]
    if r["mismatch_kinds"]:
        lines += ["", "## Reference mismatches", "", "```", share_chart(r["mismatch_kinds"]), "```"]
    if r.get("damaged_files"):
        lines += ["", "## Damaged files set aside", "", "| file | stage | reason | rows held | now at |"]
        lines += ["| --- | --- | --- | --- | --- |"]
        lines += [
            f"| {d['path']} | {d['stage']} | {d['reason']} | {d['rows'] if d['rows'] is not None else '?'} "
            f"| {d['moved_to']} |"
            for d in r["damaged_files"]
        ]
    return "\n".join(lines) + "\n"


def write_report(layout: DatasetLayout, dataset: DatasetConfig) -> dict[str, Any]:
    report = build_report(layout, dataset)
    write_json(report, layout.report_json)
    write_text(render_markdown(report), layout.report_md)
    return report
