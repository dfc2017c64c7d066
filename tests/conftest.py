"""Shared fixtures: the real embedded model and tokenizer, and small project configs in temporary folders."""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import pytest
import yaml

warnings.filterwarnings("ignore")
os.environ.setdefault("DAGSTER_DISABLE_TELEMETRY", "1")

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from eagle3_assets.core.target import builtin_dir

    return builtin_dir("smollm2")


@pytest.fixture(scope="session")
def smol_tok(smollm2_dir):
    from eagle3_assets.core.target import load_tokenizer

    return load_tokenizer(str(smollm2_dir))


@pytest.fixture(scope="session")
def chat(smol_tok):
    from eagle3_assets.core.chat_tokens import ChatTokenizer

    return ChatTokenizer(smol_tok)


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r, ensure_ascii=False)) + "\n")
    return path


def make_project(root: Path, datasets: dict[str, dict], **top) -> Path:
    """A config file in `root` with the given datasets (source rows written beside it)."""
    cfg: dict = {"storage": {"root": "data"}, "datasets": {}}
    for key, spec in datasets.items():
        rows = spec.pop("rows")
        write_jsonl(root / "prompts" / f"{key}.jsonl", rows)
        cfg["datasets"][key] = {
            "source": f"prompts/{key}.jsonl",
            "format": spec.pop("format", "messages"),
            "max_tokens": spec.pop("max_tokens", 12),
            **spec,
        }
    cfg.update(top)
    path = root / "eagle3.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def make_plan(
    key: str, max_tokens: int, budget_tokens: int, budget_usd: float | None = None, sampling=None, **run
):
    """A generation plan for a dataset section written in code (tests and benchmarks)."""
    from eagle3_assets.config import DatasetConfig, SamplingConfig
    from eagle3_assets.core.generation import GenerationPlan

    ds = DatasetConfig(
        source="(in code)",
        format="messages",
        max_tokens=max_tokens,
        budget_tokens=budget_tokens,
        budget_usd=budget_usd,
    )
    return GenerationPlan(key, ds, sampling or SamplingConfig(), **run)


def user_rows(texts: list[str], with_ids: bool = True) -> list[dict]:
    rows = []
    for i, t in enumerate(texts):
        row = {"messages": [{"role": "user", "content": t}]}
        if with_ids:
            row["id"] = f"p{i:03d}"
        rows.append(row)
    return rows
