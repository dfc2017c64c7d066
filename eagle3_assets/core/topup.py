"""Whether a dataset needs topping up: its budget is not met and there is work that would spend it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl

from .journal import ResponseJournal
from .layout import DatasetLayout


@dataclass(frozen=True)
class TopUp:
    needed: bool
    reason: str


def top_up_status(layout: DatasetLayout, source: Path, budget_tokens: int, budget_usd: float | None) -> TopUp:
    if not layout.prompts.exists():
        return TopUp(True, "prompts never ingested")
    journal = ResponseJournal(layout.dir)
    usage = journal.prior_usage()
    if usage.completion_tokens >= budget_tokens:
        return TopUp(False, f"token budget met ({usage.completion_tokens:,}/{budget_tokens:,})")
    if budget_usd is not None and usage.cost_usd >= budget_usd:
        return TopUp(False, f"dollar budget met (${usage.cost_usd:,.2f}/${budget_usd:,.2f})")
    if source.exists() and source.stat().st_mtime > layout.prompts.stat().st_mtime:
        return TopUp(True, "the source changed since prompts were ingested")
    ids = set(pl.read_parquet(layout.prompts, columns=["id"])["id"].to_list())
    left = ids - journal.done_ids() - journal.permanent_failure_ids()
    if left:
        return TopUp(
            True, f"{len(left):,} prompts unanswered, budget {usage.completion_tokens:,}/{budget_tokens:,}"
        )
    return TopUp(False, "every prompt is answered")
