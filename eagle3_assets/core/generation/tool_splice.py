"""Agent traces turn by turn: which of the source's tool results follow a target's turn that calls tools.

The source's i-th result answers its i-th call at that point; it is spliced after the target's i-th call
when the target called the same tool there (matched by position and name, as speculators' regeneration
matches cached results), and re-addressed to the target's call id. A target that called something else, or
called where the source did not, or did not call where the source did, has left the trace: the source holds
no result for what it asked, so its conversation stops there rather than glue a result to a call it does not
answer.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..target_model.tool_calls import ToolCall, parse_calls

# The failure kind of a conversation stopped where the target left the trace's tool calls: its turns up to
# there are answered and stored; the rest is not asked, and not counted as a failed request.
TOOL_DIVERGED = "tool_diverged"


def source_calls(messages: Sequence[dict], slot: int) -> list[ToolCall]:
    """The calls of the source's assistant turn at `slot` (none where the slot is past the last message)."""
    return parse_calls(messages[slot].get("tool_calls")) if slot < len(messages) else []


def has_results(messages: Sequence[dict], slot: int) -> bool:
    """Whether tool results follow the source's turn at `slot` (the next turn goes on from them)."""
    return slot + 1 < len(messages) and messages[slot + 1].get("role") == "tool"


def divergence(messages: Sequence[dict], slot: int, target: Sequence[ToolCall]) -> str | None:
    """Why the target's turn at `slot` does not fit the source's tool results there; None when it does (the
    same tools at the same positions, or no calls on either side)."""
    source = source_calls(messages, slot)
    if not source and not target:
        return None
    if not target:
        return f"the target answered in text where the source called {_names(source)}"
    if not source or not has_results(messages, slot):
        return f"the target called {_names(target)} where the source called no tool"
    if [c.name for c in target] != [c.name for c in source]:
        return f"the target called {_names(target)} where the source called {_names(source)}"
    return None


def call_ids(messages: Sequence[dict], slot: int, target: Sequence[ToolCall]) -> dict[str, str]:
    """The source's call ids at `slot` -> the target's, position by position (only where they fit)."""
    if divergence(messages, slot, target) is not None:
        return {}
    return {s.id: t.id for s, t in zip(source_calls(messages, slot), target, strict=True) if s.id and t.id}


def _names(calls: Sequence[ToolCall]) -> str:
    return ", ".join(c.name for c in calls)
