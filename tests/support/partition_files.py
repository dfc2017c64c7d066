"""Partitions' output files as the stages leave them, written without running the stages (the warehouse tests
read files, whatever produced them): journal parts through `JournalTable.append` (the stages' own writer),
tokens.parquet and the acceptance gate's report.json in the contract's columns and keys."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import obstore as obs
import polars as pl

from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.storage.tables import FAILURE_SCHEMA, RESPONSE_SCHEMA, SET_ASIDE_SCHEMA, JournalTable


def answers(
    ids: list[str], model: str = "m-a", cost: float | None = 0.01, tokens: int = 100, text: str = "answer"
) -> pl.DataFrame:
    """Response rows: `tokens` completion tokens and `cost` dollars each (the i-th row adds i to both, so
    every sum is specific)."""
    n = len(ids)
    rows = {name: [None] * n for name in RESPONSE_SCHEMA}
    rows.update(
        id=ids,
        backend=["openrouter"] * n,
        model=[model] * n,
        content=[f"{text} {i}" for i in ids],
        finish_reason=["stop"] * n,
        prompt_tokens=[10 + i for i in range(n)],
        completion_tokens=[tokens + i for i in range(n)],
        cost_usd=[None if cost is None else cost + i / 1000 for i in range(n)],
        source=["generated"] * n,
    )
    return pl.DataFrame(rows, schema=RESPONSE_SCHEMA)


def failures(ids: list[str], kind: str = "timeout", permanent: bool = False) -> pl.DataFrame:
    n = len(ids)
    rows = {name: [None] * n for name in FAILURE_SCHEMA}
    rows.update(
        id=ids,
        error_kind=[kind] * n,
        message=[f"{kind} on {i}" for i in ids],
        attempts=[3] * n,
        permanent=[permanent] * n,
    )
    return pl.DataFrame(rows, schema=FAILURE_SCHEMA)


def append_answers(root: Path, key: str, rows: pl.DataFrame) -> Path:
    layout = DatasetLayout(root, key)
    path = JournalTable(layout.responses_dir, RESPONSE_SCHEMA).append(rows)
    assert path is not None
    return path


def append_failures(root: Path, key: str, rows: pl.DataFrame) -> Path:
    path = JournalTable(DatasetLayout(root, key).failures_dir, FAILURE_SCHEMA).append(rows)
    assert path is not None
    return path


def append_set_aside(root: Path, key: str, rows: pl.DataFrame, reason: str = "prompt_edited") -> Path:
    """Answers set aside (`rows`: response rows), one aside_key each (the id and when it was stored)."""
    aside = rows.with_columns(
        aside_key=pl.col("id") + "@1",
        aside_reason=pl.lit(reason),
        aside_detail=pl.lit(None, pl.String),
        set_aside_at=pl.lit(1.0),
    )
    table = JournalTable(DatasetLayout(root, key).set_aside_dir, SET_ASIDE_SCHEMA, key="aside_key")
    path = table.append(aside.select(list(SET_ASIDE_SCHEMA)))
    assert path is not None
    return path


def write_tokens(
    root: Path, key: str, lengths: list[int], trained: list[int], match: list[bool | None]
) -> Path:
    """tokens.parquet: sample i has `lengths[i]` tokens, the last `trained[i]` of them in the loss mask."""
    path = DatasetLayout(root, key).tokens
    path.parent.mkdir(parents=True, exist_ok=True)
    pl.DataFrame(
        {
            "id": [f"{key}-{i}" for i in range(len(lengths))],
            "input_ids": [list(range(n)) for n in lengths],
            "loss_mask": [[0] * (n - t) + [1] * t for n, t in zip(lengths, trained, strict=True)],
            "reference_match": match,
        },
        schema={
            "id": pl.String,
            "input_ids": pl.List(pl.Int32),
            "loss_mask": pl.List(pl.Int8),
            "reference_match": pl.Boolean,
        },
    ).write_parquet(path)
    return path


def write_gate_report(root: Path, key: str, heldout: float, untrained: float, passed: bool = True) -> Path:
    part = lambda al: {"acceptance_length": al, "per_position": [0.5, 0.25], "n_prompts": 3, "prompt_ids": []}  # noqa: E731
    report = {
        "draft_tokens": 2,
        "engine": "transformers",
        "max_new_tokens": 16,
        "train": part(heldout + 1.0),
        "heldout": part(heldout),
        "untrained": part(untrained),
        "gate": {"passed": passed, "reasons": [] if passed else ["train acceptance too low"]},
    }
    path = DatasetLayout(root, key).acceptance_report
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report))
    return path


def write_data_value_report(root: Path, rows: list[dict]) -> Path:
    path = root / "data_value" / "report.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "suite": {"n_prompts": 5, "source": "suite.jsonl", "prompt_ids": []},
        "rows": rows,
        "floor_acceptance_length": 1.1,
        "engine": "transformers",
        "draft_tokens": 3,
    }
    path.write_text(json.dumps(report))
    return path


def upload_tree(local_root: Path, store: Any) -> int:
    """Every file under `local_root` put at the same relative key in `store`; returns how many."""
    n = 0
    for p in sorted(local_root.rglob("*")):
        if p.is_file():
            obs.put(store, str(p.relative_to(local_root)), p.read_bytes())
            n += 1
    return n
