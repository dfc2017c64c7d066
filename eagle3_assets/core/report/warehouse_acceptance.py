"""Rows of the warehouse's `acceptance` table: one per partition's gate report (`<B>/acceptance/report.json`)
and one per draft of the data_value report (`data_value/report.json`), read leniently (a key a report lacks
is null), so reports written by older versions still show."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import astuple, dataclass
from typing import Any

ACCEPTANCE_COLUMNS: list[tuple[str, str]] = [
    ("dataset", "VARCHAR"),  # the partition the draft was trained on; null for `all` and `all-but-<key>`
    ("source", "VARCHAR"),  # 'gate' (the partition's own held-out prompts) | 'data_value' (the common suite)
    ("draft", "VARCHAR"),  # the partition key, `all` or `all-but-<key>`
    ("engine", "VARCHAR"),
    ("draft_tokens", "INTEGER"),
    ("acceptance_length", "DOUBLE"),  # gate: held-out part; data_value: on the suite
    ("untrained_acceptance_length", "DOUBLE"),  # the untrained draft on the same prompts (the floor)
    ("gain_over_floor", "DOUBLE"),  # acceptance_length - untrained_acceptance_length
    ("train_acceptance_length", "DOUBLE"),  # gate: on the prompts it was trained on
    ("n_prompts", "INTEGER"),
    ("per_position", "DOUBLE[]"),
    ("passed", "BOOLEAN"),  # gate: its verdict
    ("cost_usd", "DOUBLE"),  # data_value: what the draft's answers cost
    ("completion_tokens", "BIGINT"),
    ("gpu_seconds", "DOUBLE"),
    ("usd_per_0_1_acceptance", "DOUBLE"),
    ("flags", "VARCHAR[]"),
]


@dataclass(frozen=True)
class AcceptanceRow:
    dataset: str | None
    source: str
    draft: str | None
    engine: str | None = None
    draft_tokens: int | None = None
    acceptance_length: float | None = None
    untrained_acceptance_length: float | None = None
    gain_over_floor: float | None = None
    train_acceptance_length: float | None = None
    n_prompts: int | None = None
    per_position: list[float] | None = None
    passed: bool | None = None
    cost_usd: float | None = None
    completion_tokens: int | None = None
    gpu_seconds: float | None = None
    usd_per_0_1_acceptance: float | None = None
    flags: list[str] | None = None

    def values(self) -> list[Any]:
        return list(astuple(self))


def _part(report: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    part = report.get(name)
    return part if isinstance(part, Mapping) else {}


def _gain(acceptance: Any, floor: Any) -> float | None:
    if isinstance(acceptance, int | float) and isinstance(floor, int | float):
        return float(acceptance) - float(floor)
    return None


def gate_row(key: str, report: Mapping[str, Any]) -> AcceptanceRow:
    heldout = _part(report, "heldout")
    untrained = _part(report, "untrained").get("acceptance_length")
    gate = _part(report, "gate")
    passed = gate.get("passed")
    return AcceptanceRow(
        dataset=key,
        source="gate",
        draft=key,
        engine=report.get("engine"),
        draft_tokens=report.get("draft_tokens"),
        acceptance_length=heldout.get("acceptance_length"),
        untrained_acceptance_length=untrained,
        gain_over_floor=_gain(heldout.get("acceptance_length"), untrained),
        train_acceptance_length=_part(report, "train").get("acceptance_length"),
        n_prompts=heldout.get("n_prompts"),
        per_position=heldout.get("per_position"),
        passed=bool(passed) if passed is not None else None,
        flags=list(gate.get("reasons") or []) or None,
    )


def data_value_row(row: Mapping[str, Any], keys: Sequence[str], report: Mapping[str, Any]) -> AcceptanceRow:
    """A row of the data_value report; what the report states once for all rows (engine, k, the untrained
    floor, the suite's size) fills each."""
    draft = row.get("draft")
    flags = row.get("flags")
    floor = report.get("floor_acceptance_length")
    acceptance = row.get("acceptance_length")
    gain = row.get("gain_over_floor")
    return AcceptanceRow(
        dataset=draft if draft in keys else None,
        source="data_value",
        draft=draft,
        engine=row.get("engine", report.get("engine")),
        draft_tokens=row.get("draft_tokens", report.get("draft_tokens")),
        acceptance_length=acceptance,
        untrained_acceptance_length=floor,
        gain_over_floor=gain if isinstance(gain, int | float) else _gain(acceptance, floor),
        n_prompts=row.get("n_prompts", _part(report, "suite").get("n_prompts")),
        per_position=row.get("per_position"),
        cost_usd=row.get("cost_usd"),
        completion_tokens=row.get("completion_tokens"),
        gpu_seconds=row.get("gpu_seconds"),
        usd_per_0_1_acceptance=row.get("usd_per_0_1_acceptance"),
        flags=[str(f) for f in flags] if isinstance(flags, list) and flags else None,
    )


def acceptance_rows(
    gate_reports: Mapping[str, Mapping[str, Any]],
    data_value: Mapping[str, Any] | None,
    keys: Sequence[str],
) -> list[AcceptanceRow]:
    """Gate rows in the order of `keys` (those with a report), then the data_value report's rows."""
    rows = [gate_row(k, gate_reports[k]) for k in keys if k in gate_reports]
    if data_value:
        rows += [
            data_value_row(r, keys, data_value)
            for r in data_value.get("rows") or []
            if isinstance(r, Mapping)
        ]
    return rows
