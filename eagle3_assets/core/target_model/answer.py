"""The target's answer to a conversation, as the chat templates render it: its own module, because the
template plan and the tool rendering read it as the chat tokenizer does, and neither may import the chat
tokenizer (which imports them). `chat` re-exports it, part of its API."""

from __future__ import annotations

from dataclasses import dataclass

from .tool_calls import ToolCall


@dataclass(frozen=True, slots=True)
class Answer:
    content: str
    reasoning: str | None = None
    finished: bool = True
    tool_calls: tuple[ToolCall, ...] = ()  # the calls the answer makes (rendered by `tool_render`)
