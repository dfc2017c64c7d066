"""Tool calls as every stage holds them: a call kept exactly as written, and messages with calls as an API
request and as a chat template take them.

A call is kept as its source (or the target) wrote it: `id`, `name` and `arguments`, the arguments as the
JSON text itself, never re-serialised, because the target's ids are rebuilt from that text. Messages carry
their calls as one compact JSON string (`tool_calls`), a tool result its `tool_call_id` and `name`, a
prompt its tool definitions (`tools`, OpenAI's function form) as compact JSON in the source's key order:
plain strings, so every stage's tables keep their shape and a row without tools is stored exactly as before.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# The message fields a tool row adds; a message without them is stored as it always was (role, content).
TOOL_FIELDS = ("tool_calls", "tool_call_id", "name")


def canonical(obj: Any) -> str:
    """Compact JSON in the source's own key order: the stored form of tool definitions and calls. Never
    sorted: a template writes a tool definition (`tool | tojson`) in the order its keys come, and the prompt
    must be the one the server renders from the same request."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call: `arguments` is the JSON text exactly as written (the target's ids are rebuilt from it)."""

    name: str
    arguments: str
    id: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}

    def parsed_arguments(self) -> Any:
        """The arguments as a JSON value, or the text itself where it is not JSON."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments

    @property
    def arguments_valid(self) -> bool:
        try:
            return isinstance(json.loads(self.arguments), dict)
        except ValueError:
            return False


def calls_json(calls: Sequence[ToolCall]) -> str | None:
    """The stored form of a message's calls; None for none."""
    return canonical([c.as_dict() for c in calls]) if calls else None


def parse_calls(text: str | None) -> list[ToolCall]:
    """Calls back from their stored form."""
    if not text:
        return []
    return [ToolCall(c["name"], c["arguments"], c.get("id")) for c in json.loads(text)]


# -- to a request and to a chat template -----------------------------------------------------------------
def wire_message(m: Mapping[str, Any]) -> dict[str, Any]:
    """A stored message as OpenAI's chat-completions API takes it."""
    calls = parse_calls(m.get("tool_calls"))
    if not calls and m["role"] != "tool":
        return {k: v for k, v in m.items() if k not in TOOL_FIELDS}
    out = {k: v for k, v in m.items() if k not in TOOL_FIELDS and v is not None}
    if calls:
        out["content"] = m.get("content") or None
        out["tool_calls"] = [
            {
                "id": c.id or f"call_{j}",
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for j, c in enumerate(calls)
        ]
    if m["role"] == "tool":
        out["tool_call_id"] = m.get("tool_call_id") or "call_0"
        if m.get("name"):
            out["name"] = m["name"]
    return out


def template_message(m: Mapping[str, Any]) -> dict[str, Any]:
    """A stored message as chat templates take it: calls in OpenAI's form with their arguments parsed to an
    object where they are JSON (templates write `arguments | tojson`; vLLM and SGLang parse them the same
    way before rendering a request's history)."""
    out = wire_message(m)
    if "tool_calls" in out:
        out["content"] = m.get("content") or ""
        out["tool_calls"] = [
            {**c, "function": {**c["function"], "arguments": _template_arguments(c["function"]["arguments"])}}
            for c in out["tool_calls"]
        ]
    return out


def _template_arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def has_tool_fields(messages: Sequence[Mapping[str, Any]]) -> bool:
    return any(m.get(f) for m in messages for f in TOOL_FIELDS)


# The finish reasons of an answer the model ended itself (its end-of-turn token written): a reply, or a turn
# that ends in its calls.
FINISHED_REASONS = ("stop", "tool_calls")


def finished(reason: str | None) -> bool:
    return reason in FINISHED_REASONS


# The marks that open a call in the tool formats the platform renders (Kimi's section, Hermes/Qwen's tag,
# Llama-3.1's built-in-tool tag). Found in the text of an answer whose calls came back empty, they are a call
# the server did not parse: reasoning that ran into the call without its end-of-thinking mark (a Kimi failure
# met in the field), or a server started without a tool-call parser.
CALL_MARKS = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<tool_call>", "<|python_tag|>")


def unparsed_call(reasoning: str | None, content: str | None) -> str | None:
    """Where a call sits unparsed in an answer's text: a description of it, or None."""
    for part, text in (("reasoning", reasoning), ("content", content)):
        for mark in CALL_MARKS:
            if text and mark in text:
                return f"a tool call left unparsed in the answer's {part} ({mark!r})"
    return None
