"""What a draft's data cost: the dollars and completion tokens of the answers bought for its datasets (from
their stored answers) and the GPU-seconds spent on them (extraction of their hidden states plus the draft's
own training), and the price of a tenth of acceptance length over the untrained floor."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..storage.layout import DatasetLayout
from ..storage.tables import RESPONSE_SCHEMA, JournalTable

# The step of acceptance length a price is quoted for: "dollars per 0.1 of acceptance length".
PRICE_STEP = 0.1


@dataclass(frozen=True)
class BoughtAnswers:
    """A partition's whole bought set: every stored answer (`responses/*.parquet`), whatever the draft then
    trained on: that is what the dataset cost, and what buying it again would cost."""

    answers: int = 0
    cost_usd: float = 0.0
    completion_tokens: int = 0
    priced_answers: int = 0  # answers with a cost (a local backend's have none)

    @classmethod
    def read(cls, layout: DatasetLayout) -> BoughtAnswers:
        if not layout.responses_dir.exists():
            return cls()
        # As every report reads the journal: one row per id (the first copy), cut-short parts skipped.
        df = JournalTable(layout.responses_dir, RESPONSE_SCHEMA).read(keep="first")
        if df.height == 0:
            return cls()
        return cls(
            answers=df.height,
            cost_usd=float(df["cost_usd"].fill_null(0.0).sum()),
            completion_tokens=int(df["completion_tokens"].fill_null(0).sum()),
            priced_answers=int(df["cost_usd"].is_not_null().sum()),
        )

    @classmethod
    def total(cls, parts: Iterable[BoughtAnswers]) -> BoughtAnswers:
        parts = list(parts)
        return cls(
            answers=sum(p.answers for p in parts),
            cost_usd=sum(p.cost_usd for p in parts),
            completion_tokens=sum(p.completion_tokens for p in parts),
            priced_answers=sum(p.priced_answers for p in parts),
        )


@dataclass(frozen=True)
class Price:
    usd_per_0_1_acceptance: float | None
    flags: list[str]


def price_of_gain(cost_usd: float, acceptance_length: float, floor: float) -> Price:
    """cost_usd / ((acceptance_length - floor) / 0.1): dollars per 0.1 of acceptance length over the untrained
    floor; None, with a flag saying why, where nothing was paid or nothing was gained."""
    gain = acceptance_length - floor
    if cost_usd <= 0:
        return Price(None, ["no-cost: no answer of these datasets was paid for"])
    if gain <= 0:
        return Price(None, [f"no-gain: acceptance length {acceptance_length:.3f} <= floor {floor:.3f}"])
    return Price(round(cost_usd / (gain / PRICE_STEP), 6), [])
