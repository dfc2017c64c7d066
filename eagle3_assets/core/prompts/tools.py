"""Tool definitions, calls and results of a source row, checked and normalised: a malformed call, a call to a
tool the row does not offer, or arguments that are not a JSON object quarantine the row with the reason."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import polars as pl

from ..target_model.tool_calls import ToolCall, calls_json, parse_calls
from .reading import RowError


# -- from a source row -----------------------------------------------------------------------------------
def normalise_tools(value: Any, where: str = "tools") -> list[dict[str, Any]]:
    """Tool definitions in OpenAI's form `{type: function, function: {name, description, parameters}}`, from
    that form, a bare `{name, description, parameters}` (ShareGPT dumps) or a JSON string of either list."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            raise RowError(f"{where}: not valid JSON") from None
    if not isinstance(value, list):
        raise RowError(f"{where}: must be a list of tool definitions")
    out = []
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, dict) and "function" in tool else tool
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise RowError(f"{where}[{i}]: a tool definition needs a function name")
        out.append({"type": "function", "function": fn})
    return out


def tool_names(tools: Sequence[Mapping[str, Any]] | None) -> set[str]:
    return {t["function"]["name"] for t in tools or ()}


def _arguments(value: Any, where: str) -> str:
    """A call's arguments as JSON text: a string is kept as written (it must be a JSON object), an object is
    written as compact JSON."""
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    if not isinstance(value, str):
        raise RowError(f"{where}: arguments must be a JSON object or its text")
    try:
        parsed = json.loads(value)
    except ValueError:
        raise RowError(f"{where}: arguments are not valid JSON") from None
    if not isinstance(parsed, dict):
        raise RowError(f"{where}: arguments are not a JSON object")
    return value


def normalise_call(value: Any, where: str, offered: set[str] | None) -> ToolCall:
    """One call from OpenAI's `{id, type, function: {name, arguments}}` or a bare `{name, arguments}`;
    a call to a tool the row does not offer (where it offers any) is refused."""
    fn = value.get("function") if isinstance(value, dict) and "function" in value else value
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
        raise RowError(f"{where}: malformed tool call (no function name)")
    name = fn["name"]
    if offered is not None and name not in offered:
        raise RowError(f"{where}: call to unknown tool {name!r} (not among the row's tools)")
    call_id = value.get("id") if isinstance(value, dict) else None
    if call_id is not None and not isinstance(call_id, str):
        raise RowError(f"{where}: tool call id must be a string")
    return ToolCall(name, _arguments(fn.get("arguments", {}), where), call_id)


def normalise_calls(value: Any, where: str, offered: set[str] | None) -> list[ToolCall]:
    if not isinstance(value, list) or not value:
        raise RowError(f"{where}: tool_calls must be a non-empty list")
    return [normalise_call(c, f"{where}.tool_calls[{j}]", offered) for j, c in enumerate(value)]


def link_results(messages: list[dict[str, Any]]) -> None:
    """Give each tool result the id and name of the call it answers: by its `tool_call_id` where it has one,
    else by position among the calls of the assistant turn before it (RowError where neither fits)."""
    n = 0
    for m in messages:  # calls without an id (ShareGPT's) get one by their place in the conversation
        calls = parse_calls(m.get("tool_calls"))
        if any(c.id is None for c in calls):
            calls = [
                c if c.id else ToolCall(c.name, c.arguments, f"call_{n + j}") for j, c in enumerate(calls)
            ]
            m["tool_calls"] = calls_json(calls)
        n += len(calls)
    pending: list[ToolCall] = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            pending = parse_calls(m.get("tool_calls"))
            continue
        if m["role"] != "tool":
            pending = []
            continue
        if not pending:
            raise RowError(f"messages[{i}]: a tool result without a tool call before it")
        want = m.get("tool_call_id")
        call = next((c for c in pending if want is not None and c.id == want), None)
        if call is None and want is not None and any(c.id for c in pending):
            raise RowError(f"messages[{i}]: tool result for unknown call id {want!r}")
        call = call or pending[0]
        pending.remove(call)
        if m.get("name") and m["name"] != call.name:
            raise RowError(f"messages[{i}]: tool result named {m['name']!r} answers a call to {call.name!r}")
        m["tool_call_id"] = want or call.id
        m["name"] = call.name


@dataclass(frozen=True)
class RowTools:
    """The stored `tools` and `tool_choice` of a frame of prompts (compact JSON; None for a row without,
    and for every row of a dataset without tools, whose prompts.parquet has neither column)."""

    tools: list[str | None]
    tool_choice: list[str | None]

    @classmethod
    def of(cls, prompts: pl.DataFrame) -> RowTools:
        def column(name: str) -> list[str | None]:
            return prompts[name].to_list() if name in prompts.columns else [None] * prompts.height

        return cls(column("tools"), column("tool_choice"))

    def choice(self, i: int) -> Any:
        """Row i's `tool_choice` as the source has it (a string such as "auto", or an object)."""
        value = self.tool_choice[i]
        return None if value is None else json.loads(value)
