"""Exact ids and loss masks of conversations with tools, from the template's real rendering.

Each template writes tool definitions and calls in its own format (Hermes/Qwen `<tool_call>` JSON, Llama-3.1
JSON, Kimi's tool-call tokens), so the sentinel plans of `chat` do not apply: a call's arguments are JSON the
template re-serialises. Instead the conversation is rendered as transformers' `apply_chat_template(...,
tools=...)` renders it, cut into segments at the turns the target wrote (from the rendering of each turn's
own prompt), and each segment encoded as a server encodes a rendered prompt (added tokens parsed). The
segments' ids must equal the whole rendering's ids, so the row is exactly `apply_chat_template(...,
tokenize=True)`; where they do not, the row is refused with the reason, never guessed.

Trained: the target's own turns, from the end of their generation prompt to their end-of-turn token, calls
included. Never trained: tool definitions, tool results, anything the template writes around them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from .template_render import failure_reason
from .tool_calls import ToolCall, calls_json, template_message

if TYPE_CHECKING:
    from .answer import Answer


class ToolChat(Protocol):
    """What tool rendering reads of a chat tokenizer (`chat.ChatTokenizer` is one): named here, so that this
    module needs nothing of the chat tokenizer, which builds a renderer (no circle)."""

    @property
    def tok(self) -> Any: ...

    @property
    def kwargs(self) -> dict[str, Any]: ...

    @property
    def think_open(self) -> str: ...

    @property
    def think_close(self) -> str: ...

    @property
    def template_has_reasoning(self) -> bool: ...

    @property
    def eot_token(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Segment:
    text: str
    trained: bool


class ToolRenderer:
    """Renders and encodes tool conversations for one ChatTokenizer (its template, options and markers)."""

    def __init__(self, chat: ToolChat):
        self.chat = chat

    # -- messages as the template takes them ----------------------------------------------------------------
    def message(self, m: dict[str, Any]) -> dict[str, Any]:
        """A stored message (tool fields, `reasoning` beside the content) as the template takes it."""
        out = template_message(m)
        out.pop("reasoning", None)
        reasoning = m.get("reasoning")
        if reasoning and m.get("role") == "assistant":
            if self.chat.template_has_reasoning:
                out["reasoning_content"] = reasoning
            else:
                out["content"] = (
                    f"{self.chat.think_open}{reasoning}{self.chat.think_close}{out['content'] or ''}"
                )
        return out

    def answer_message(self, answer: Answer) -> dict[str, Any]:
        return self.message(
            {
                "role": "assistant",
                "content": answer.content,
                "reasoning": answer.reasoning,
                "tool_calls": calls_json(list(answer.tool_calls)),
            }
        )

    def render(self, messages: list[dict[str, Any]], tools: list[dict] | None, gen: bool) -> str:
        kwargs = dict(self.chat.kwargs)
        if tools:
            kwargs["tools"] = tools
        return self.chat.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=gen, **kwargs
        )

    # -- segments -------------------------------------------------------------------------------------------
    def segments(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict] | None,
        answer: Answer | None,
        train_all: bool,
    ) -> tuple[list[Segment], int]:
        """The rendering cut at the target's turns; and which segment starts the generated turn (its index,
        or len(segments) for a prompt alone)."""
        msgs = [self.message(dict(m)) for m in messages]
        prompt = self.render(msgs, tools, True)
        spans = self._history_spans(msgs, tools, prompt) if train_all else []
        cuts: list[Segment] = []
        at = 0
        for start, end in spans:
            cuts += [Segment(prompt[at:start], False), Segment(prompt[start:end], True)]
            at = end
        cuts.append(Segment(prompt[at:], False))
        if answer is None:
            return cuts, len(cuts)
        full = self.render([*msgs, self.answer_message(answer)], tools, False)
        if not full.startswith(prompt):
            raise ValueError(
                "the template renders the prompt differently once an answer follows it "
                "(check target.chat_template_kwargs, e.g. the thinking switch)"
            )
        return [*cuts, Segment(self._answer_text(full[len(prompt) :], prompt, answer), True)], len(cuts)

    def _answer_text(self, text: str, prompt: str, answer: Answer) -> str:
        """What the target wrote of its turn: to its end-of-turn token when it finished."""
        chat = self.chat
        if answer.reasoning and answer.reasoning not in text:
            # The template drops the final turn's reasoning (Kimi K2.5 does for a plain reply): the turn in
            # the thinking form the model itself produced it in.
            if answer.tool_calls:
                raise ValueError("the template drops the reasoning of an answer that calls a tool")
            opener = "" if prompt.endswith(chat.think_open) else chat.think_open
            text = f"{opener}{answer.reasoning}{chat.think_close}{answer.content}{chat.eot_token}"
        if answer.finished:
            pos = text.rfind(chat.eot_token)
            if pos < 0:
                raise ValueError(f"the template writes no {chat.eot_token!r} after an assistant answer")
            return text[: pos + len(chat.eot_token)]
        if answer.tool_calls:
            raise ValueError(
                "an answer cut by max_tokens inside a tool call cannot be rebuilt from its parsed call"
            )
        last = answer.content or answer.reasoning or ""
        pos = text.rfind(last)
        return text[: pos + len(last)] if last else ""

    def _history_spans(
        self, msgs: list[dict[str, Any]], tools: list[dict] | None, prompt: str
    ) -> list[tuple[int, int]]:
        """Where each earlier assistant turn is in the prompt's rendering, checked to render there as it did
        when it was the turn being written."""
        spans = []
        for k, m in enumerate(msgs):
            if m["role"] != "assistant":
                continue
            head = self.render(msgs[:k], tools, True)
            turn = self.render(msgs[: k + 1], tools, False)
            if not (prompt.startswith(head) and turn.startswith(head)):
                raise ValueError(f"the template renders turn {k} differently in later context")
            written = turn[len(head) :]
            pos = written.rfind(self.chat.eot_token)
            cut = written[: pos + len(self.chat.eot_token)] if pos >= 0 else written
            if not prompt.startswith(cut, len(head)):
                raise ValueError(
                    f"the template renders assistant turn {k} differently once later turns follow"
                )
            spans.append((len(head), len(head) + len(cut)))
        return spans

    # -- ids ------------------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """As a server encodes the prompt it rendered, and as `apply_chat_template(tokenize=True)` does."""
        return list(self.chat.tok(text, add_special_tokens=False)["input_ids"])

    def tokenize(
        self,
        messages: Sequence[dict[str, Any]],
        tools: list[dict] | None,
        answer: Answer | None,
        train_all: bool = False,
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """(input_ids, loss_mask, answer_start); ValueError with the reason where the row cannot be exact.

        The prompt is encoded whole, as the server encoded the prompt it rendered; the generated turn on its
        own, as the model wrote it after that prompt (a vocabulary that would merge the two across the
        boundary gives the ids the model produced, not the whole text's)."""
        segments, answer_at = self.segments(messages, tools, answer, train_all)
        head = segments[:answer_at]
        ids = self.encode("".join(s.text for s in head))
        mask = [0] * len(ids)
        if any(s.trained for s in head):
            parts = [(self.encode(s.text), s.trained) for s in head]
            if [i for p, _ in parts for i in p] != ids:
                raise ValueError(
                    "an earlier assistant turn's ids merge with the text around it in the prompt, so its "
                    "ids cannot be cut out exactly"
                )
            mask = [int(t) for p, t in parts for _ in p]
        start = len(ids)
        for seg in segments[answer_at:]:
            part = self.encode(seg.text)
            ids += part
            mask += [int(seg.trained)] * len(part)
        return np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.int8), start


def tools_of(value: str | None) -> list[dict] | None:
    """A prompt's stored tool definitions."""
    return json.loads(value) if value else None


def render_error(error: Exception) -> str:
    return str(error) if isinstance(error, ValueError) else failure_reason(error)


__all__ = ["Segment", "ToolCall", "ToolRenderer", "render_error", "tools_of"]
