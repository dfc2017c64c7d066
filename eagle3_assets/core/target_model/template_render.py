"""The target's chat template as text: conversation shapes rendered with sentinels for their texts, real
conversations rendered one by one or many in one call, and whether the template is proven to write every text
verbatim (then no row needs its own rendering)."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any, cast

from .template_plan import CLOSE, OPEN, FormatText, Shape, sentinel, text_index
from .verbatim import verbatim_problem

PlainRenderer = Callable[[list[list[dict[str, str]]], bool], list[str]]


def failure_reason(error: Exception) -> str:
    """Why a conversation has no ids when the template raised on it."""
    return f"chat template failed: {type(error).__name__}: {error}"


class ChatTemplate:
    """Renders with the tokenizer's chat template and its options. Reasoning goes in the template's own field
    (`reasoning_content`) when it has one, else before the content between the think markers, as the model
    wrote it."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template_kwargs: dict[str, Any] | None,
        think_open: str,
        think_close: str,
    ):
        self.tok = tokenizer
        self.kwargs = dict(chat_template_kwargs or {})
        self.think_open, self.think_close = think_open, think_close
        self.template_has_reasoning = "reasoning_content" in (tokenizer.chat_template or "")
        # verbatim_problem None: the template is proven to write every text verbatim (no row is rendered
        # again); else why not.
        self._render_plain, self.verbatim_problem = self._plain_renderer()
        self._sentinel_renders: dict[tuple, FormatText] = {}

    def messages(
        self, roles: Sequence[str], reasoning: Sequence[bool], text: Callable[[int, str], str]
    ) -> list[dict[str, str]]:
        """Chat messages of a shape, texts from `text(index, "c" | "r")` (sentinels or the real texts)."""
        msgs = []
        for i, (role, has_r) in enumerate(zip(roles, reasoning, strict=True)):
            msg = {"role": role, "content": text(i, "c")}
            if has_r:
                if self.template_has_reasoning:
                    msg["reasoning_content"] = text(i, "r")
                else:
                    msg["content"] = f"{self.think_open}{text(i, 'r')}{self.think_close}{msg['content']}"
            msgs.append(msg)
        return msgs

    def filled_messages(
        self, roles: Sequence[str], reasoning: Sequence[bool], texts: Sequence[str]
    ) -> list[dict[str, str]]:
        """Chat messages of a shape with its flat texts (`flat_texts`)."""
        if not any(reasoning):  # the common case, without a call per text
            return [{"role": r, "content": texts[2 * i]} for i, r in enumerate(roles)]
        return self.messages(roles, reasoning, lambda i, f: texts[text_index(i, f)])

    def template_messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
        """Stored messages (`reasoning` beside the content) as this template takes them, as `tokenize` renders
        them: the reasoning in the template's own field, or before the content between the think markers."""
        shape = Shape.of(messages, None)
        return self.messages(
            shape.roles,
            shape.reasoning,
            lambda i, f: messages[i]["content"] if f == "c" else messages[i].get("reasoning") or "",
        )

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.kwargs
        )

    def render_shape(self, roles: Sequence[str], reasoning: Sequence[bool], gen: bool) -> str:
        """A shape rendered with a sentinel in place of every text."""
        return self.render(self.messages(roles, reasoning, sentinel), gen)

    def sentinel_render(self, roles: tuple[str, ...], reasoning: tuple[bool, ...], gen: bool) -> FormatText:
        """A shape's sentinel rendering as a format text: filled with a row's texts, it is what the template
        renders for the row when it writes the texts verbatim."""
        key = (roles, reasoning, gen)
        found = self._sentinel_renders.get(key)
        if found is None:
            found = self._sentinel_renders[key] = FormatText.of_sentinels(
                self.render_shape(roles, reasoning, gen)
            )
        return found

    def end_of_turn_written(self, controls: re.Pattern[str] | None) -> str | None:
        """The control token the template itself writes right after an assistant answer (Kimi: <|im_end|>, not
        its eos [EOS]); None when the template writes none."""
        if controls is None:
            return None
        try:
            text = self.render_shape(("user", "assistant"), (False, False), False)
        except Exception:
            return None
        _, sep, tail = text.partition(sentinel(1, "c"))
        m = controls.search(tail) if sep else None
        return m.group(0) if m else None

    def _plain_renderer(self) -> tuple[PlainRenderer, str | None]:
        """Renders conversations of plain dicts of strings in one call, as apply_chat_template does.

        apply_chat_template first normalises its input (message objects to dicts, None values dropped: a deep
        copy of every conversation) and then calls transformers' `render_jinja_template` with the tokenizer's
        template and special tokens. Conversations built here are already plain, so the renderer calls that
        second step itself (a third cheaper per row, measured): same function, same arguments, same text. A
        tokenizer class with its own apply_chat_template (remote code may bring one) keeps the public call.

        Also returns why the template is not proven to write texts verbatim (None when it is): the proof reads
        the very template this renderer renders."""
        from transformers import PreTrainedTokenizerBase

        render: Callable[..., Any] | None
        try:
            from transformers.utils.chat_template_utils import render_jinja_template as render
        except ImportError:  # a transformers without it: the tokenizer's own call
            render = None
        cls = type(self.tok)
        if render is None or not (
            getattr(cls, "apply_chat_template", None) is PreTrainedTokenizerBase.apply_chat_template
            and getattr(cls, "get_chat_template", None) is PreTrainedTokenizerBase.get_chat_template
        ):
            return (
                lambda convs, gen: cast(
                    list[str],
                    self.tok.apply_chat_template(
                        convs, tokenize=False, add_generation_prompt=gen, **self.kwargs
                    ),
                ),
                "the tokenizer class renders with its own apply_chat_template",
            )
        template = self.tok.get_chat_template()
        template_kwargs = {**self.tok.special_tokens_map, **self.kwargs}
        problem = (
            "a template option or special token holds a sentinel character"
            if any(c in repr(template_kwargs) for c in OPEN + CLOSE)
            else verbatim_problem(template, reserved=OPEN + CLOSE)
        )
        jinja = render
        return (
            lambda convs, gen: cast(
                list[str],
                jinja(
                    conversations=convs, chat_template=template, add_generation_prompt=gen, **template_kwargs
                )[0],
            )
        ), problem

    def render_many(self, convs: list[list[dict[str, str]]], gen: bool) -> list[str | Exception]:
        """Real conversations (plain dicts of strings) rendered in one call (40% cheaper per row than one call
        each); row by row if the template raises."""
        if not convs:
            return []
        try:
            return list(self._render_plain(convs, gen))
        except Exception:
            out: list[str | Exception] = []
            for c in convs:
                try:
                    out.append(self.render(c, gen))
                except Exception as e:
                    out.append(e)
            return out
