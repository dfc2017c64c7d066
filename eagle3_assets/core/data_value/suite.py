"""The common held-out suite: its prompts, read by the prompts stage's own ingestion (a file in a dataset's
formats, or a configured dataset held out), rendered with the target's chat template as the gate renders its
heldout prompts, and refused where any of them is also a training prompt of some partition.

An overlap is refused rather than dropped: a suite prompt that some draft trained on inflates that draft's
figure, and a silently shortened suite would make two reports of the same config incomparable."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from ...config import DatasetConfig, ProjectConfig
from ..acceptance.measure import PromptSet
from ..acceptance.samples import GateSample, rendered_prompts
from ..prompts.context import ContextGuard, PromptGuard
from ..prompts.fingerprints import prompt_fingerprint
from ..prompts.ingest import ingest, read_prompts
from ..target_model.chat import ChatTokenizer
from ..target_model.tool_render import tools_of


class SuiteOverlap(ValueError):
    """Suite prompts that are also training prompts; nothing was trained."""


@dataclass(frozen=True)
class SuitePrompt:
    id: str
    messages: list[dict[str, Any]]
    tools: list[dict] | None = None


@dataclass
class Suite:
    """The suite's prompts in source order, and where they came from (a file, or `dataset:<key>`)."""

    origin: str
    prompts: list[SuitePrompt]
    held_out_dataset: str | None = None  # the dataset that is the suite: no draft trains on it
    n_source_prompts: int = 0  # prompts the source holds (the suite takes the first max_prompts)
    # Suite rows left out before any training, with the prompts stage's reason: too long for the target's
    # context (less the measured output), or malformed.
    quarantined: dict[str, str] = field(default_factory=dict)
    # The suite's rows as the prompts stage stores a partition's (prompts.parquet's columns): what the target
    # is asked, as any partition's prompts are (`suite_answers`).
    frame: pl.DataFrame | None = None

    @property
    def ids(self) -> list[str]:
        return [p.id for p in self.prompts]

    def rendered(self, chat: ChatTokenizer) -> PromptSet:
        """The generation prompts as a server tokenizes them, exactly as the gate renders its heldout ones."""
        samples = [
            GateSample(p.id, p.messages, np.zeros(0, np.int32), np.zeros(0, np.int8), tools=p.tools)
            for p in self.prompts
        ]
        return PromptSet(self.ids, rendered_prompts(chat, samples))


def load_suite(cfg: ProjectConfig, guard: PromptGuard | None = None) -> Suite:
    """The configured suite's first `max_prompts` usable prompts, ingested as the prompts stage ingests a
    dataset: malformed rows, and with `guard` the prompts it refuses (too long for the target), are
    quarantined (named in `Suite.quarantined`), never measured."""
    if cfg.data_value is None:
        raise ValueError("data_value is not configured")
    s = cfg.data_value.suite
    if s.dataset is not None:
        d: DatasetConfig = cfg.dataset(s.dataset)
        path, fmt, fields, system, tools = (
            cfg.resolve_path(d.source),
            d.format,
            d.fields.model_dump(),
            d.system_prompt,
            d.tools,
        )
        origin = f"dataset:{s.dataset} ({d.source})"
    else:
        assert s.source is not None  # the config requires one of the two
        path, fmt, fields, system, tools = (
            cfg.resolve_path(s.source),
            s.format,
            s.fields.model_dump(),
            s.system_prompt,
            None,
        )
        origin = str(s.source)
    if not path.exists():
        raise FileNotFoundError(
            f"data_value.suite: {path} does not exist; fix data_value.suite in the config"
        )
    got = ingest(Path(path), fmt, fields, system, guard, tools)
    rows = got.prompts
    quarantined = {
        str(pid if pid is not None else f"row {n}"): reason
        for pid, n, reason in got.quarantine.select("id", "source_row", "reason").iter_rows()
    }
    if rows.height == 0:
        why = "; ".join(f"{k}: {v}" for k, v in quarantined.items())
        raise ValueError(f"data_value.suite: {path} holds no usable prompt" + (f" ({why})" if why else ""))
    has_tools = "tools" in rows.columns
    prompts = [
        SuitePrompt(
            r["id"],
            [{k: v for k, v in m.items() if v is not None} for m in r["messages"]],
            tools_of(r["tools"]) if has_tools else None,
        )
        for r in rows.head(s.max_prompts).iter_rows(named=True)
    ]
    return Suite(origin, prompts, s.dataset, rows.height, quarantined, rows.head(s.max_prompts))


def suite_guard(target_guard: ContextGuard, new_tokens: int) -> ContextGuard:
    """The prompts stage's context guard (`Target.context_guard`) with room kept for the `new_tokens` every
    draft decodes after each suite prompt (`acceptance.max_new_tokens` + the draft's tokens): a prompt that
    fits the context but not its measured output would be cut by the engine, and every row with it."""
    room = max(1, target_guard.context - new_tokens)
    return replace(
        target_guard,
        context=room,
        source=f"{target_guard.source or 'target context'} {target_guard.context:,} less {new_tokens} "
        "measured new tokens",
    )


def normalised_text(messages: list[dict[str, Any]]) -> str:
    """The prompt's words, case and spacing aside: the same question copied between datasets with other
    whitespace or capitals is the same question."""
    text = "\n".join(f"{m.get('role', '')}: {m.get('content') or ''}" for m in messages)
    return re.sub(r"\s+", " ", text).strip().lower()


@dataclass(frozen=True)
class Overlap:
    suite_id: str
    partition: str
    partition_id: str
    how: str  # "fingerprint" or "normalised text"

    def __str__(self) -> str:
        return f"suite {self.suite_id} = {self.partition}/{self.partition_id} (same {self.how})"


def overlaps(suite: Suite, training: Mapping[str, pl.DataFrame]) -> list[Overlap]:
    """Every (suite prompt, training prompt) pair with the same prompt fingerprint or the same normalised
    text. `training`: each partition's prompts (`id`, `messages`, and `fingerprint` where stored)."""
    by_print = {prompt_fingerprint(p.messages): p.id for p in suite.prompts}
    by_text = {normalised_text(p.messages): p.id for p in suite.prompts}
    found = []
    for key, df in training.items():
        prints = df["fingerprint"].to_list() if "fingerprint" in df.columns else [None] * df.height
        for pid, messages, fp in zip(df["id"].to_list(), df["messages"].to_list(), prints, strict=True):
            msgs = [{k: v for k, v in m.items() if v is not None} for m in messages]
            sid = by_print.get(fp) if fp else None
            sid = sid or by_print.get(prompt_fingerprint(msgs))
            if sid is not None:
                found.append(Overlap(sid, key, pid, "fingerprint"))
            elif (sid := by_text.get(normalised_text(msgs))) is not None:
                found.append(Overlap(sid, key, pid, "normalised text"))
    return found


def refuse_overlaps(suite: Suite, prompt_files: Mapping[str, Path]) -> None:
    """SuiteOverlap naming every overlapping row, where a suite prompt is a prompt of a training partition
    (`prompt_files`: each partition's prompts.parquet; the dataset held out as the suite is not one)."""
    training = {
        k: read_prompts(p) for k, p in prompt_files.items() if k != suite.held_out_dataset and p.exists()
    }
    found = overlaps(suite, training)
    if found:
        shown = "; ".join(str(o) for o in found[:20])
        more = f" and {len(found) - 20} more" if len(found) > 20 else ""
        raise SuiteOverlap(
            f"data_value: {len(found)} suite prompt(s) are also training prompts, nothing was trained: "
            f"{shown}{more}. Remove them from the suite ({suite.origin}) or from the dataset."
        )
