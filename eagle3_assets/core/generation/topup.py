"""Whether a dataset needs topping up: its budget is not met and there is work that would spend it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import polars as pl

from ...config import DatasetConfig
from ..storage.layout import DatasetLayout
from .budget import Budget
from .journal import ResponseJournal


@dataclass(frozen=True)
class TopUp:
    needed: bool
    reason: str


def top_up_status(layout: DatasetLayout, dataset: DatasetConfig) -> TopUp:
    """Whether generation has work: prompts never ingested, or room in the budget and prompts still
    unanswered."""
    if not layout.prompts.exists():
        return TopUp(True, "prompts never ingested")
    journal = ResponseJournal(layout)
    # The same rule as dispatch: a dataset with no room left for one more answer is done.
    budget = Budget.for_dataset(dataset, journal.prior_usage())
    if not budget.can_dispatch():
        return TopUp(False, f"budget met ({budget.describe()})")
    ids = set(pl.read_parquet(layout.prompts, columns=["id"])["id"].to_list())
    left = ids - journal.done_ids() - journal.permanent_failure_ids()
    if left:
        return TopUp(True, f"{len(left):,} prompts unanswered, budget {budget.describe()}")
    return TopUp(False, "every prompt is answered")


def source_changed(ingested_at: float | None, source: Path) -> bool:
    """The dataset's source file is newer than its ingested prompts (or they were never ingested)."""
    if ingested_at is None:
        return True
    return source.exists() and source.stat().st_mtime > ingested_at
