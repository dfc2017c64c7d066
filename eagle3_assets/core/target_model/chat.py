"""Exact token ids and loss masks of conversations, rebuilt with the target's own chat template.

How it works: the template is rendered once per conversation *shape* (roles, which turns carry reasoning) with
sentinels in place of every text (`template_render`); the rendered string is cut into control tokens
(added-token strings the template itself wrote) and text runs (template text plus message text), cached as a
plan (`template_plan`). Each conversation then fills the plan's text runs with its own text, all runs are
encoded in one batch without added-token matching, and the ids are spliced with the control ids.

The generated turn is its own segment: it starts right after the generation prompt (where the model started to
write) and ends with the end-of-turn token when the answer finished, so its ids are what the model emitted and
can be compared with the ids a server returned. Only trained segments get loss-mask 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from itertools import pairwise
from typing import Any

import numpy as np

from .answer import Answer
from .rewrites import rebuilt_row
from .template_plan import (
    CLOSE,
    OPEN,
    SENTINEL,
    PlanCutter,
    PlannedRow,
    Shape,
    TemplatePlan,
    flat_texts,
    sentinel,
    splice,
    text_index,
)
from .template_render import ChatTemplate, failure_reason
from .text_encoder import TextEncoder, make_text_encoder
from .tool_calls import has_tool_fields
from .tool_render import ToolRenderer, render_error


class TemplateError(ValueError):
    """The conversation cannot be rendered exactly (its reason goes to tokens_errors.parquet)."""


class TextRewritten(TemplateError):
    """The template renders without error but rewrites this conversation's text (Llama-3 trims every message):
    the ids of the plan are not what the model saw, so the row is rebuilt from the real rendering if it can
    be."""

    @classmethod
    def between(cls, real: str, filled: str) -> TextRewritten:
        """The first place where the template's real rendering differs from the plan filled with the texts."""
        at = next(
            (i for i, (a, b) in enumerate(zip(real, filled, strict=False)) if a != b),
            min(len(real), len(filled)),
        )
        return cls(
            "the chat template rewrites this conversation's text (e.g. trims or strips it), so its ids "
            f"cannot be rebuilt exactly: at character {at} the template wrote {real[at : at + 24]!r} "
            f"where the text has {filled[at : at + 24]!r}"
        )


@dataclass(slots=True)
class TokenizedConversation:
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8
    answer_start: int  # the generated turn spans input_ids[answer_start:]

    @property
    def answer_ids(self) -> np.ndarray:
        return self.input_ids[self.answer_start :]


@dataclass(frozen=True)
class ChatRecipe:
    """How to build a ChatTokenizer anywhere (a worker process): the target's tokenizer and template
    settings."""

    ref: str
    trust_remote_code: bool = False
    revision: str | None = None
    kwargs_json: str = "{}"
    end_of_turn_token: str | None = None
    think_open: str = "<think>"
    think_close: str = "</think>"


@lru_cache(maxsize=4)
def chat_tokenizer(recipe: ChatRecipe) -> ChatTokenizer:
    """One ChatTokenizer per recipe and process."""
    import json

    from .loading import load_tokenizer

    tok = load_tokenizer(recipe.ref, recipe.trust_remote_code, recipe.revision)
    chat = ChatTokenizer(
        tok, json.loads(recipe.kwargs_json), recipe.end_of_turn_token, recipe.think_open, recipe.think_close
    )
    chat.recipe = recipe
    return chat


class DeferredChat:
    """Stands in for the ChatTokenizer of `recipe`, loaded at its first use. A backend that sends text and
    gets its usage back (OpenRouter, single turns) never uses it while generating, and loading it
    (transformers and the tokenizer, about a second of a fresh process) would be most of a generating step's
    wait for its first request."""

    def __init__(self, recipe: ChatRecipe):
        self.recipe = recipe

    def __getattr__(self, name: str) -> Any:
        return getattr(chat_tokenizer(self.recipe), name)


# The rule for rebuilding rows a template rewrites (see fingerprint).
REBUILD = 2


class ChatTokenizer(ChatTemplate):
    recipe: ChatRecipe | None = None  # set when built from a recipe: worker processes can then rebuild it

    def __init__(
        self,
        tokenizer: Any,
        chat_template_kwargs: dict[str, Any] | None = None,
        end_of_turn_token: str | None = None,
        think_open: str = "<think>",
        think_close: str = "</think>",
        encoder: TextEncoder | None = None,
    ):
        self.encoder = encoder or make_text_encoder(tokenizer)
        if not tokenizer.chat_template:
            raise TemplateError("the tokenizer has no chat template: use a chat model's tokenizer")
        super().__init__(tokenizer, chat_template_kwargs, think_open, think_close)
        self._cutter = PlanCutter(self.encoder)
        self._plans: dict[tuple[Shape, bool], TemplatePlan] = {}
        self.eot_token = (
            end_of_turn_token or self.end_of_turn_written(self._cutter.controls) or tokenizer.eos_token
        )
        if not self.eot_token:
            raise TemplateError(
                "cannot tell the end-of-turn token: set target.end_of_turn_token in the config"
            )
        self.eot_id = self.encoder.control_ids.get(self.eot_token)

    @property
    def stop_ids(self) -> set[int]:
        """The ids that end an answer: the template's end-of-turn token and the tokenizer's eos."""
        return {i for i in (self.eot_id, self.tok.eos_token_id) if i is not None}

    def fingerprint(self) -> str:
        """What decides the ids of a conversation besides its text: the template, its options, the
        vocabulary."""
        import hashlib
        import json

        parts = [
            self.tok.chat_template or "",
            json.dumps(self.kwargs, sort_keys=True),
            self.eot_token or "",
            self.think_open,
            self.think_close,
            str(len(self.tok)),
            str(getattr(self.tok, "name_or_path", "")),
            json.dumps(sorted(self.encoder.control_ids.items())),
        ]
        if self.verbatim_problem is not None:
            # Rows of a template not proven verbatim may be rebuilt; how is versioned so that rows tokenized
            # (or refused) under an earlier rule are done again (2: answers with reasoning in the content
            # rebuilt).
            parts.append(f"rebuild={REBUILD}")
        return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).hexdigest()

    def count_tokens(self, text: str) -> int:
        """Tokens of plain text with the target tokenizer (for answers that came without usage)."""
        return len(self.encoder.encode_texts([text])[0])

    def keeps_history(self, messages: Sequence[dict[str, Any]], answer: Answer) -> bool:
        """Whether every assistant turn of this conversation renders in the final conversation exactly as it
        did when it was the turn being written (the template keeps the history verbatim: ChatML does; Kimi
        K2.5 and Qwen3 drop earlier reasoning), for a template proven to write texts verbatim. Then one row
        with every assistant turn trained equals what the model saw at each turn."""
        if self.verbatim_problem is not None or has_tool_fields(messages) or answer.tool_calls:
            return False
        try:
            self._plan(Shape.of(messages, answer), True)
        except Exception:
            return False
        return True

    def tokenize(
        self,
        conversations: Sequence[tuple[Sequence[dict[str, Any]], Answer | None]],
        train_all: bool = False,
        tools: Sequence[list[dict] | None] | None = None,
    ) -> list[TokenizedConversation | TemplateError]:
        """Tokenize many conversations in one batch; one that cannot be rendered yields its error. A
        conversation with tools (`tools[i]`), tool calls or tool results is rendered by `tool_render`."""
        agentic = [
            i
            for i, (m, a) in enumerate(conversations)
            if (tools is not None and tools[i]) or has_tool_fields(m) or (a is not None and a.tool_calls)
        ]
        if not agentic:
            return self._tokenize_plain(conversations, train_all)
        out: list[TokenizedConversation | TemplateError | None] = [None] * len(conversations)
        for i in agentic:
            out[i] = self.tokenize_tools(
                *conversations[i], tools[i] if tools is not None else None, train_all
            )
        rest = [i for i in range(len(conversations)) if out[i] is None]
        for i, res in zip(
            rest, self._tokenize_plain([conversations[i] for i in rest], train_all), strict=True
        ):
            out[i] = res
        return [r for r in out if r is not None]

    def tokenize_tools(
        self,
        messages: Sequence[dict[str, Any]],
        answer: Answer | None,
        tools: list[dict] | None,
        train_all: bool = False,
    ) -> TokenizedConversation | TemplateError:
        """One conversation with tools, from the template's real rendering (`tool_render`)."""
        try:
            ids, mask, start = self.tool_renderer.tokenize(messages, tools, answer, train_all)
        except Exception as e:
            return TemplateError(render_error(e))
        return TokenizedConversation(ids, mask, start)

    @property
    def tool_renderer(self) -> ToolRenderer:
        return ToolRenderer(self)

    def _tokenize_plain(
        self, conversations: Sequence[tuple[Sequence[dict[str, Any]], Answer | None]], train_all: bool
    ) -> list[TokenizedConversation | TemplateError]:
        rows = self._planned_rows(conversations, train_all)
        self._settle_rewritten(rows, train_all)
        planned = [r for r in rows if isinstance(r, PlannedRow)]
        texts: list[str] = []
        at_start: list[bool] = []
        for planned_row in planned:
            for fill in planned_row.plan.fills:
                texts.append(fill.text(planned_row.texts))
                at_start.append(fill.at_start)
        encoded = self.encoder.encode_texts(texts, at_start)
        batch = splice([r.plan for r in planned], encoded)
        spans = iter(batch.spans)
        out: list[TokenizedConversation | TemplateError] = []
        for row in rows:
            if isinstance(row, TemplateError):
                out.append(row)
                continue
            s = next(spans)
            out.append(
                TokenizedConversation(
                    batch.ids[s.begin : s.end], batch.mask[s.begin : s.end], s.answer_start - s.begin
                )
            )
        return out

    def prompt_ids(
        self, prompts: Sequence[Sequence[dict[str, Any]]], tools: Sequence[list[dict] | None] | None = None
    ) -> list[list[int] | TemplateError]:
        """The generation prompt of each conversation (with its tools), as the model must see it."""
        res = self.tokenize([(p, None) for p in prompts], tools=tools)
        return [r if isinstance(r, TemplateError) else r.input_ids.tolist() for r in res]

    # -- a batch's rows -------------------------------------------------------------------------------------
    def _planned_rows(
        self, conversations: Sequence[tuple[Sequence[dict[str, Any]], Answer | None]], train_all: bool
    ) -> list[PlannedRow | TemplateError]:
        rows: list[PlannedRow | TemplateError] = []
        for index, (messages, answer) in enumerate(conversations):
            try:
                shape = Shape.of(messages, answer)
                texts = flat_texts(messages, answer)
                rows.append(PlannedRow(index, shape, texts, self._plan(shape, train_all)))
            except TemplateError as e:
                rows.append(e)
            except Exception as e:  # a template that raises on this input
                rows.append(TemplateError(failure_reason(e)))
        return rows

    def _settle_rewritten(self, rows: list[PlannedRow | TemplateError], train_all: bool) -> None:
        """Rows whose text the template does not write verbatim: rebuilt from the real rendering where they
        can be, else replaced by their error."""
        for index, error in self._verify([r for r in rows if isinstance(r, PlannedRow)]).items():
            row = rows[index]
            if train_all or not isinstance(row, PlannedRow) or not isinstance(error, TextRewritten):
                # Not rebuilt: a row that trains every turn (each earlier turn was written after a prompt of
                # its own, which one rendering cannot give), or a template that fails on the row.
                rows[index] = error
                continue
            rebuilt = rebuilt_row(self, self.encoder, row)
            rows[index] = TextRewritten(f"{rebuilt}; {error}") if isinstance(rebuilt, str) else rebuilt

    def _verify(self, rows: list[PlannedRow]) -> dict[int, TemplateError]:
        """Every row: the template must place this row's text verbatim. Templates that trim (Llama-3's `|
        trim`), strip newlines around reasoning (Qwen3) or rewrite content would otherwise get ids the
        template never produces; checked per row, since whether text is rewritten depends on the text, not on
        the shape, and the verdict must not depend on which rows came first.

        A template proven to write texts verbatim under shape-only control flow (`verbatim`) renders
        every row of a shape as its plan: rows whose texts are all strings skip the render."""
        bad: dict[int, TemplateError] = {}
        if self.verbatim_problem is None:
            # Rows with a non-string text or a sentinel in a role are still checked.
            rows = [
                r
                for r in rows
                if not all(type(v) is str for v in r.texts)
                or any(OPEN in x or CLOSE in x for x in r.shape.roles)
            ]
        for gen in (False, True):
            group = [r for r in rows if r.shape.prompt_only is gen]
            reals = self.render_many(
                [self.filled_messages(r.shape.roles, r.shape.reasoning, r.texts) for r in group], gen
            )
            for row, real in zip(group, reals, strict=True):
                if isinstance(real, Exception):
                    bad[row.index] = TemplateError(failure_reason(real))
                    continue
                filled = self.sentinel_render(row.shape.roles, row.shape.reasoning, gen).filled(row.texts)
                if real != filled:
                    bad[row.index] = TextRewritten.between(real, filled)
        return bad

    # -- planning -------------------------------------------------------------------------------------------
    def _plan(self, shape: Shape, train_all: bool) -> TemplatePlan:
        key = (shape, train_all)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._make_plan(shape, train_all)
        return plan

    def _make_plan(self, shape: Shape, train_all: bool) -> TemplatePlan:
        roles, reasoning = shape.roles, shape.reasoning
        n_prompt = len(roles) - (0 if shape.prompt_only else 1)
        prompt_text = self.render_shape(roles[:n_prompt], reasoning[:n_prompt], True)
        # Boundaries (start, end) of trained turns inside the prompt, then the generated turn.
        spans = self._trained_turns(shape, n_prompt, prompt_text) if train_all else []
        full_text = prompt_text
        if shape.answer is not None:
            last = len(roles) - 1
            written = {
                text_index(last, f)
                for f, has in (("c", shape.answer.has_content), ("r", shape.answer.has_reasoning))
                if has
            }
            cut = self._cut_answer(self._answer_text(shape, prompt_text), shape.answer.finished, written)
            full_text = prompt_text + cut
            spans.append((len(prompt_text), len(full_text)))
        if any(start < end for (_, end), (start, _) in pairwise(spans)):
            raise TemplateError("assistant turns overlap in the rendered conversation")
        return self._cutter.plan(full_text, spans)

    def _trained_turns(self, shape: Shape, n_prompt: int, prompt_text: str) -> list[tuple[int, int]]:
        """Where each assistant turn of the prompt is in its rendering, checked to render there as it did when
        it was the turn being written."""
        roles, reasoning = shape.roles, shape.reasoning
        spans: list[tuple[int, int]] = []
        for k in range(n_prompt):
            if roles[k] != "assistant":
                continue
            head = self.render_shape(roles[:k], reasoning[:k], True)
            turn = self.render_shape(roles[: k + 1], reasoning[: k + 1], False)
            if not (prompt_text.startswith(head) and turn.startswith(head)):
                raise TemplateError(f"the template renders turn {k} differently in later context")
            cut = self._cut_answer(turn[len(head) :], True, set())
            if not prompt_text.startswith(cut, len(head)):
                # e.g. Qwen3-style templates write thinking only into the last assistant turn
                raise TemplateError(
                    f"the template renders assistant turn {k} differently once later turns follow"
                )
            spans.append((len(head), len(head) + len(cut)))
        return spans

    def _answer_text(self, shape: Shape, prompt_text: str) -> str:
        """The rendering of the generated turn, after the prompt's."""
        full = self.render_shape(shape.roles, shape.reasoning, False)
        if not full.startswith(prompt_text):
            raise TemplateError(
                "the template renders the prompt differently once an answer follows it "
                "(check target.chat_template_kwargs, e.g. the thinking switch)"
            )
        answer_text = full[len(prompt_text) :]
        last = len(shape.roles) - 1
        if shape.reasoning[last] and sentinel(last, "r") not in answer_text:
            # The template drops the reasoning of the final turn (Kimi K2.5 does): write the turn in the
            # thinking form the model itself produced it in.
            opener = "" if prompt_text.endswith(self.think_open) else self.think_open
            answer_text = (
                f"{opener}{sentinel(last, 'r')}{self.think_close}{sentinel(last, 'c')}{self.eot_token}"
            )
        return answer_text

    def _cut_answer(self, text: str, finished: bool, written: set[int]) -> str:
        """The part of the rendered answer turn that the model itself wrote: to its end-of-turn token when it
        finished, else to the last of its `written` texts (flat indices)."""
        sentinels = list(SENTINEL.finditer(text))
        if finished:
            last_end = sentinels[-1].end() if sentinels else 0
            pos = text.find(self.eot_token, last_end)
            if pos < 0:
                raise TemplateError(f"the template writes no {self.eot_token!r} after an assistant answer")
            return text[: pos + len(self.eot_token)]
        done = [m for m in sentinels if text_index(int(m.group(1)), m.group(2)) in written]
        return text[: done[-1].end()] if done else ""
