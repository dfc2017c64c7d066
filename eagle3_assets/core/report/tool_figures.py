"""What the report says of an agentic dataset's answers: how many call tools, how many calls each, calls whose
arguments are not a JSON object, calls to tools the row did not offer, and conversations stopped where the
target left the trace's calls (`generation.tool_splice`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import polars as pl

from ..generation.conversations import split_turn_id
from ..generation.tool_splice import TOOL_DIVERGED
from ..target_model.tool_calls import parse_calls


@dataclass
class ToolCallFigures:
    answers_with_calls: int = 0
    calls_share: float = 0.0  # of the answers
    calls: int = 0
    calls_per_answer_with_calls: float | None = None
    arguments_not_json: int = 0  # calls whose arguments are not a JSON object
    calls_to_tools_not_offered: int = 0
    # turns: all: conversations stopped where the target called other tools than the source (or none)
    conversations_stopped_at_divergence: int = 0

    @classmethod
    def of(
        cls, responses: pl.DataFrame, prompts: pl.DataFrame | None, failures: pl.DataFrame
    ) -> ToolCallFigures:
        """`responses`: id and tool_calls, one row per answer; `prompts`: id and tools (None, or no `tools`
        column: a dataset without tools); `failures`: error_kind."""
        offered: dict[str, set[str]] = {}
        if prompts is not None and "tools" in prompts.columns:
            for pid, tools in prompts.select("id", "tools").iter_rows():
                offered[pid] = {t["function"]["name"] for t in json.loads(tools)} if tools else set()
        out = cls()
        with_calls = responses.filter(pl.col("tool_calls").is_not_null())
        for rid, text in with_calls.select("id", "tool_calls").iter_rows():
            calls = parse_calls(text)
            if not calls:
                continue
            out.answers_with_calls += 1
            out.calls += len(calls)
            out.arguments_not_json += sum(not c.arguments_valid for c in calls)
            parsed = split_turn_id(rid)
            names = offered.get(rid, offered.get(parsed[0], set()) if parsed else set())
            out.calls_to_tools_not_offered += sum(c.name not in names for c in calls)
        out.calls_share = out.answers_with_calls / responses.height if responses.height else 0.0
        out.calls_per_answer_with_calls = (
            out.calls / out.answers_with_calls if out.answers_with_calls else None
        )
        if failures.height:
            out.conversations_stopped_at_divergence = int((failures["error_kind"] == TOOL_DIVERGED).sum())
        return out
