"""Whether a dataset needs topping up: its budget is not met and there is work that would spend it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl

from .budget import Budget
from .journal import ResponseJournal
from .layout import DatasetLayout


@dataclass(frozen=True)
class TopUp:
    needed: bool
    reason: str


def top_up_status(
    layout: DatasetLayout, source: Path, budget_tokens: int, budget_usd: float | None, max_tokens: int
) -> TopUp:
    if not layout.prompts.exists():
        return TopUp(True, "prompts never ingested")
    journal = ResponseJournal(layout.dir)
    usage = journal.prior_usage()
    # The same rule as dispatch: a run that stopped on its budget (reserving for requests in flight) is done.
    budget = Budget(
        max_tokens,
        budget_tokens,
        budget_usd,
        usage.completion_tokens,
        usage.cost_usd,
        tokens=usage.token_stats,
        usd=usage.usd_stats,
    )
    if not budget.can_dispatch():
        return TopUp(False, f"budget met ({budget.describe()})")
    if source.exists() and source.stat().st_mtime > layout.prompts.stat().st_mtime:
        return TopUp(True, "the source changed since prompts were ingested")
    ids = set(pl.read_parquet(layout.prompts, columns=["id"])["id"].to_list())
    left = ids - journal.done_ids() - journal.permanent_failure_ids()
    if left:
        return TopUp(
            True, f"{len(left):,} prompts unanswered, budget {usage.completion_tokens:,}/{budget_tokens:,}"
        )
    return TopUp(False, "every prompt is answered")
