"""Exact token ids and loss masks of conversations, rebuilt with the target's own chat template.

How it works: the template is rendered once per conversation *shape* (roles, which turns carry reasoning) with
sentinels in place of every text; the rendered string is cut into control tokens (added-token strings the template
itself wrote) and text runs (template text plus message text), cached as a plan. Each conversation then fills the
plan's text runs with its own text, all runs are encoded in one batch without added-token matching, and the ids are
spliced with the control ids.

The generated turn is its own segment: it starts right after the generation prompt (where the model started to
write) and ends with the end-of-turn token when the answer finished, so its ids are what the model emitted and
can be compared with the ids a server returned. Only trained segments get loss-mask 1.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from .text_encoder import TextEncoder, make_text_encoder
from .verbatim import verbatim_problem

_OPEN, _CLOSE = "\ue000", "\ue001"
_SENTINEL = re.compile(f"{_OPEN}(\\d+)([cr]){_CLOSE}")


def _format_string(parts: Sequence[str | None]) -> str:
    """Literal text (braces escaped) with `{}` where a message text goes (None)."""
    return "".join("{}" if p is None else p.replace("{", "{{").replace("}", "}}") for p in parts)


def _strip(text: str, left: bool, right: bool) -> str:
    if right:
        text = text.rstrip()
    if left:
        text = text.lstrip()
    return text


class TemplateError(ValueError):
    """The conversation cannot be rendered exactly (its reason goes to tokens_errors.parquet)."""


class TextRewritten(TemplateError):
    """The template renders without error but rewrites this conversation's text (Llama-3 trims every message):
    the ids of the plan are not what the model saw, so the row is rebuilt from the real rendering if it can be."""


@dataclass(frozen=True, slots=True)
class Answer:
    content: str
    reasoning: str | None = None
    finished: bool = True


@dataclass(slots=True)
class TokenizedConversation:
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8
    answer_start: int  # the generated turn spans input_ids[answer_start:]

    @property
    def answer_ids(self) -> np.ndarray:
        return self.input_ids[self.answer_start :]


# A plan item: a control id, or a text run made of literal strings and (message index, 'c'|'r') references.
Fragment = str | tuple[int, str]
Item = tuple[int, None] | tuple[None, tuple[Fragment, ...]]


@dataclass(frozen=True, slots=True)
class _Plan:
    # Per region of the conversation (pieces, trained), a piece being (CONTROL, id), (FIXED, ids) for a text run
    # with no message text in it (encoded once, when the plan is made) or (FILL, k) for the k-th run to fill.
    pieces: tuple[tuple[tuple[tuple[int, Any], ...], bool], ...]
    # Per run to fill: (format string with {} where message texts go, their indices into the flat
    # [content0, reasoning0, content1, ...] list, strip the right end, strip the left end, opens the input).
    fills: tuple[tuple[str, tuple[int, ...], bool, bool, bool], ...]


CONTROL, FIXED, FILL = 0, 1, 2


@dataclass(frozen=True)
class ChatRecipe:
    """How to build a ChatTokenizer anywhere (a worker process): the target's tokenizer and template settings."""

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
    """Stands in for the ChatTokenizer of `recipe`, loaded at its first use. A backend that sends text and gets its
    usage back (OpenRouter, single turns) never uses it while generating, and loading it (transformers and the
    tokenizer, about a second of a fresh process) was most of a generating step's wait for its first request."""

    def __init__(self, recipe: ChatRecipe):
        self.recipe = recipe

    def __getattr__(self, name: str) -> Any:
        return getattr(chat_tokenizer(self.recipe), name)


# The rule for rebuilding rows a template rewrites (see fingerprint).
REBUILD = 2


class ChatTokenizer:
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
        self.tok = tokenizer
        self.encoder = encoder or make_text_encoder(tokenizer)
        self.kwargs = dict(chat_template_kwargs or {})
        self.think_open, self.think_close = think_open, think_close
        template = tokenizer.chat_template or ""
        if not template:
            raise TemplateError("the tokenizer has no chat template: use a chat model's tokenizer")
        self.template_has_reasoning = "reasoning_content" in template
        strings = sorted(self.encoder.control_ids, key=len, reverse=True)
        self._control_re = re.compile("|".join(re.escape(s) for s in strings)) if strings else None
        self._plans: dict[tuple, _Plan] = {}
        # verbatim_problem None: the template is proven to write every text verbatim (no row is rendered again);
        # else why not.
        self._render_plain, self.verbatim_problem = self._plain_renderer()
        self._sentinel_renders: dict[tuple, tuple[str, tuple[int, ...]]] = {}
        self.eot_token = end_of_turn_token or self._detect_end_of_turn() or tokenizer.eos_token
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
        """What decides the ids of a conversation besides its text: the template, its options, the vocabulary."""
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
            # Rows of a template not proven verbatim may be rebuilt; how is versioned so that rows tokenized (or
            # refused) under an earlier rule are done again (2: answers with reasoning in the content rebuilt).
            parts.append(f"rebuild={REBUILD}")
        return hashlib.blake2b("\x1f".join(parts).encode(), digest_size=8).hexdigest()

    def count_tokens(self, text: str) -> int:
        """Tokens of plain text with the target tokenizer (for answers that came without usage)."""
        return len(self.encoder.encode_texts([text])[0])

    def _detect_end_of_turn(self) -> str | None:
        """The control token the template itself writes right after an assistant answer (Kimi: <|im_end|>, not
        its eos [EOS]); None when the template writes none."""
        if self._control_re is None:
            return None
        try:
            text = self._render_shape(("user", "assistant"), (False, False), False)
        except Exception:
            return None
        _, sep, tail = text.partition(f"{_OPEN}1c{_CLOSE}")
        m = self._control_re.search(tail) if sep else None
        return m.group(0) if m else None

    # -- rendering ------------------------------------------------------------------------------------------
    def _messages(
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

    def template_messages(self, messages: Sequence[dict[str, Any]]) -> list[dict[str, str]]:
        """Stored messages (`reasoning` beside the content) as this template takes them, as `tokenize` renders
        them: the reasoning in the template's own field, or before the content between the think markers."""
        roles, reasoning = self._shape(messages, None)
        return self._messages(
            roles,
            reasoning,
            lambda i, f: messages[i]["content"] if f == "c" else messages[i].get("reasoning") or "",
        )

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **self.kwargs
        )

    def _render_shape(self, roles: Sequence[str], reasoning: Sequence[bool], gen: bool) -> str:
        return self.render(self._messages(roles, reasoning, lambda i, f: f"{_OPEN}{i}{f}{_CLOSE}"), gen)

    # -- planning -------------------------------------------------------------------------------------------
    def _cut_answer(self, text: str, finished: bool, nonempty: set[tuple[int, str]]) -> str:
        """The part of the rendered answer turn that the model itself wrote."""
        sentinels = list(_SENTINEL.finditer(text))
        if finished:
            last_end = sentinels[-1].end() if sentinels else 0
            pos = text.find(self.eot_token, last_end)
            if pos < 0:
                raise TemplateError(f"the template writes no {self.eot_token!r} after an assistant answer")
            return text[: pos + len(self.eot_token)]
        written = [m for m in sentinels if (int(m.group(1)), m.group(2)) in nonempty]
        return text[: written[-1].end()] if written else ""

    def _items(self, text: str) -> tuple[Item, ...]:
        items: list[Item] = []
        frags: list[Fragment] = []

        def template_text(chunk: str) -> None:
            pos = 0
            if self._control_re is not None:
                for m in self._control_re.finditer(chunk):
                    if m.start() > pos:
                        frags.append(chunk[pos : m.start()])
                    if frags:
                        items.append((None, tuple(frags)))
                        frags.clear()
                    items.append((self.encoder.control_ids[m.group(0)], None))
                    pos = m.end()
            if pos < len(chunk):
                frags.append(chunk[pos:])

        pos = 0
        for m in _SENTINEL.finditer(text):
            template_text(text[pos : m.start()])
            frags.append((int(m.group(1)), m.group(2)))
            pos = m.end()
        template_text(text[pos:])
        if frags:
            items.append((None, tuple(frags)))
        return tuple(items)

    def _plan(
        self, roles: tuple[str, ...], reasoning: tuple[bool, ...], answer: tuple | None, train_all: bool
    ) -> _Plan:
        key = (roles, reasoning, answer, train_all)
        plan = self._plans.get(key)
        if plan is not None:
            return plan
        n_prompt = len(roles) - (1 if answer is not None else 0)
        prompt_text = self._render_shape(roles[:n_prompt], reasoning[:n_prompt], True)
        # Boundaries (start, end) of trained turns inside the prompt, then the generated turn.
        spans: list[tuple[int, int]] = []
        if train_all:
            for k in range(n_prompt):
                if roles[k] != "assistant":
                    continue
                head = self._render_shape(roles[:k], reasoning[:k], True)
                turn = self._render_shape(roles[: k + 1], reasoning[: k + 1], False)
                if not (prompt_text.startswith(head) and turn.startswith(head)):
                    raise TemplateError(f"the template renders turn {k} differently in later context")
                nonempty = {(k, "c"), (k, "r")}
                cut = self._cut_answer(turn[len(head) :], True, nonempty)
                if not prompt_text.startswith(cut, len(head)):
                    # e.g. Qwen3-style templates write thinking only into the last assistant turn
                    raise TemplateError(
                        f"the template renders assistant turn {k} differently once later turns follow"
                    )
                spans.append((len(head), len(head) + len(cut)))
        full_text = prompt_text
        if answer is not None:
            finished, nonempty = answer
            full = self._render_shape(roles, reasoning, False)
            if not full.startswith(prompt_text):
                raise TemplateError(
                    "the template renders the prompt differently once an answer follows it "
                    "(check target.chat_template_kwargs, e.g. the thinking switch)"
                )
            answer_text = full[len(prompt_text) :]
            last = len(roles) - 1
            if reasoning[last] and f"{_OPEN}{last}r{_CLOSE}" not in answer_text:
                # The template drops the reasoning of the final turn (Kimi K2.5 does): write the turn in the
                # thinking form the model itself produced it in.
                opener = "" if prompt_text.endswith(self.think_open) else self.think_open
                answer_text = (
                    f"{opener}{_OPEN}{last}r{_CLOSE}{self.think_close}{_OPEN}{last}c{_CLOSE}{self.eot_token}"
                )
            cut = self._cut_answer(answer_text, finished, set(nonempty))
            full_text = prompt_text + cut
            spans.append((len(prompt_text), len(full_text)))
        regions: list[tuple[tuple[Item, ...], bool]] = []
        pos = 0
        for start, end in spans:
            if start < pos:
                raise TemplateError("assistant turns overlap in the rendered conversation")
            if start > pos:
                regions.append((self._items(full_text[pos:start]), False))
            regions.append((self._items(full_text[start:end]), True))
            pos = end
        if pos < len(full_text) or not regions:
            regions.append((self._items(full_text[pos:]), False))
        plan = self._compile(tuple(regions))
        self._plans[key] = plan
        return plan

    def _compile(self, regions: tuple[tuple[tuple[Item, ...], bool], ...]) -> _Plan:
        """Turn a plan's items into pieces: text runs without message text are encoded here, once per plan
        (a third to a half of all runs: the newlines and role names between control tokens), the others become
        format strings."""
        flat = [item for items, _ in regions for item in items]
        lstrip, rstrip = self.encoder.lstrip_ids, self.encoder.rstrip_ids
        pieces: list[tuple[tuple[tuple[int, Any], ...], bool]] = []
        fills: list[tuple[str, tuple[int, ...], bool, bool, bool]] = []
        k = 0
        for items, trained in regions:
            out: list[tuple[int, Any]] = []
            for cid, frags in items:
                if cid is not None:
                    out.append((CONTROL, cid))
                    k += 1
                    continue
                # An added token with lstrip/rstrip absorbs the whitespace beside it when the whole text is
                # encoded (Mistral's [/INST]); the run must give it up too.
                strip_right = k + 1 < len(flat) and flat[k + 1][0] in lstrip
                strip_left = k > 0 and flat[k - 1][0] in rstrip
                at_start = k == 0
                refs = tuple(2 * f[0] + (f[1] == "r") for f in frags if not isinstance(f, str))
                if not refs:
                    text = _strip("".join(frags), strip_left, strip_right)  # type: ignore[arg-type]
                    out.append((FIXED, tuple(self.encoder.encode_texts([text], [at_start])[0])))
                else:
                    fmt = _format_string([f if isinstance(f, str) else None for f in frags])
                    out.append((FILL, len(fills)))
                    fills.append((fmt, refs, strip_right, strip_left, at_start))
                k += 1
            pieces.append((tuple(out), trained))
        return _Plan(tuple(pieces), tuple(fills))

    # -- tokenizing -----------------------------------------------------------------------------------------
    @staticmethod
    def _shape(messages: Sequence[dict[str, Any]], answer: Answer | None) -> tuple:
        roles = tuple(m["role"] for m in messages) + (("assistant",) if answer is not None else ())
        reasoning = tuple(bool(m.get("reasoning")) for m in messages)
        if answer is not None:
            reasoning += (bool(answer.reasoning),)
        return roles, reasoning

    def _values(self, messages: Sequence[dict[str, Any]], answer: Answer | None) -> list[str]:
        """The texts, flat: content0, reasoning0, content1, reasoning1, ... (reasoning "" where there is none)."""
        vals = [t for m in messages for t in (m["content"], m.get("reasoning") or "")]
        if answer is not None:
            vals += [answer.content or "", answer.reasoning or ""]
        return vals

    def _sentinel(self, roles: tuple, reasoning: tuple, gen: bool) -> tuple[str, tuple[int, ...]]:
        """A shape's sentinel render as a format string and the flat indices of the texts that fill it."""
        key = (roles, reasoning, gen)
        found = self._sentinel_renders.get(key)
        if found is None:
            text = self._render_shape(roles, reasoning, gen)
            refs = tuple(2 * int(m.group(1)) + (m.group(2) == "r") for m in _SENTINEL.finditer(text))
            literal = _SENTINEL.split(text)[::3]  # the split keeps the two groups: every third part is text
            fmt = _format_string([x for part in literal for x in (None, part)][1:])
            found = self._sentinel_renders[key] = (fmt, refs)
        return found

    def _plain_renderer(self) -> tuple[Callable[[list[list[dict[str, str]]], bool], list[str]], str | None]:
        """Renders conversations of plain dicts of strings in one call, as apply_chat_template does.

        apply_chat_template first normalises its input (message objects to dicts, None values dropped: a deep
        copy of every conversation) and then calls transformers' `render_jinja_template` with the tokenizer's
        template and special tokens. Conversations built here are already plain, so the renderer calls that second
        step itself (a third cheaper per row, measured): same function, same arguments, same text. A tokenizer
        class with its own apply_chat_template (remote code may bring one) keeps the public call.

        Also returns why the template is not proven to write texts verbatim (None when it is): the proof reads the
        very template this renderer renders."""
        try:
            from transformers import PreTrainedTokenizerBase
            from transformers.utils.chat_template_utils import render_jinja_template
        except ImportError:
            render_jinja_template = None
        cls = type(self.tok)
        if render_jinja_template is None or not (
            getattr(cls, "apply_chat_template", None) is PreTrainedTokenizerBase.apply_chat_template
            and getattr(cls, "get_chat_template", None) is PreTrainedTokenizerBase.get_chat_template
        ):
            return (
                lambda convs, gen: self.tok.apply_chat_template(
                    convs, tokenize=False, add_generation_prompt=gen, **self.kwargs
                ),
                "the tokenizer class renders with its own apply_chat_template",
            )
        template = self.tok.get_chat_template()
        template_kwargs = {**self.tok.special_tokens_map, **self.kwargs}
        problem = (
            "a template option or special token holds a sentinel character"
            if any(c in repr(template_kwargs) for c in _OPEN + _CLOSE)
            else verbatim_problem(template, reserved=_OPEN + _CLOSE)
        )
        return (
            lambda convs, gen: render_jinja_template(
                conversations=convs, chat_template=template, add_generation_prompt=gen, **template_kwargs
            )[0]
        ), problem

    def _render_many(self, convs: list[list[dict[str, str]]], gen: bool) -> list[str | Exception]:
        """The real conversations (plain dicts of strings) rendered in one call (40% cheaper per row than one call
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

    def _verify(self, rows: list[tuple[int, tuple, tuple, list[str], bool]]) -> dict[int, TemplateError]:
        """Every row: the template must place this row's text verbatim. Templates that trim (Llama-3's `| trim`),
        strip newlines around reasoning (Qwen3) or rewrite content would otherwise get ids the template never
        produces; checked per row, since whether text is rewritten depends on the text, not on the shape, and the
        verdict must not depend on which rows came first.

        A template proven to write texts verbatim under shape-only control flow (`verbatim`) renders
        every row of a shape as its plan: rows whose texts are all strings skip the render."""
        bad: dict[int, TemplateError] = {}
        if self.verbatim_problem is None:
            # Rows with a non-string text or a sentinel in a role are still checked.
            rows = [
                r
                for r in rows
                if not all(type(v) is str for v in r[3]) or any(_OPEN in x or _CLOSE in x for x in r[1])
            ]
        for gen in (False, True):
            group = [r for r in rows if r[4] is gen]
            reals = self._render_many(
                [
                    [{"role": r, "content": values[2 * i]} for i, r in enumerate(roles)]
                    if not any(reasoning)  # the common case, without a call per text
                    else self._messages(roles, reasoning, lambda i, f, v=values: v[2 * i + (f == "r")])
                    for _, roles, reasoning, values, _ in group
                ],
                gen,
            )
            for (row, roles, reasoning, values, _), real in zip(group, reals, strict=True):
                if isinstance(real, Exception):
                    bad[row] = TemplateError(f"chat template failed: {type(real).__name__}: {real}")
                    continue
                fmt, refs = self._sentinel(roles, reasoning, gen)
                filled = fmt.format(*[values[i] for i in refs])
                if real != filled:
                    at = next(
                        (i for i, (a, b) in enumerate(zip(real, filled, strict=False)) if a != b),
                        min(len(real), len(filled)),
                    )
                    bad[row] = TextRewritten(
                        "the chat template rewrites this conversation's text (e.g. trims or strips it), so its ids "
                        f"cannot be rebuilt exactly: at character {at} the template wrote {real[at : at + 24]!r} "
                        f"where the text has {filled[at : at + 24]!r}"
                    )
        return bad

    def _rebuild(
        self, entry: tuple[_Plan, list[str]], rows: list[tuple[int, tuple, tuple, list[str], bool]], row: int
    ) -> tuple[_Plan, list[str]] | str:
        """A conversation whose text the template rewrites (Llama-3 trims every message): the prompt is what the
        template renders for it (what the model saw, encoded from the real rendering, as a server encodes the prompt
        it rendered), the answer what the model wrote, ending where the template ends a turn (the plan's generated
        turn, filled with the texts as they are). A prompt alone (a request's prompt ids) is the rendering alone.
        Returns the rebuilt plan, or why the row cannot be rebuilt."""
        plan, values = entry
        _, roles, reasoning, _, prompt_only = next(r for r in rows if r[0] == row)
        if not all(type(v) is str for v in values):
            return "a message text is not a string"
        if not prompt_only:
            if not plan.pieces[-1][1]:
                return "the answer has no span of its own in the rendered conversation"
            if reasoning[-1] and self.template_has_reasoning:
                # The template writes the answer's reasoning in its own field and may rewrite it as it does the
                # other texts (Qwen3 strips its newlines): where the model's own thinking ended cannot be told from
                # the parsed reasoning. (A template without a reasoning field never sees it: the answer is
                # written in the thinking form the model produced, `<think>…</think>` then the content, exactly
                # as for a template that writes texts verbatim.)
                return (
                    "the answer carries reasoning the template writes in its own field and may rewrite, so where "
                    "the model's thinking ended cannot be told"
                )
            answer = plan.pieces[-1][0]
            fixed = [self.encoder.decode(list(p)) for kind, p in answer if kind == FIXED]
            if not any(kind == FILL for kind, _ in answer) or any(_OPEN in t or _CLOSE in t for t in fixed):
                # e.g. the template upper-cases the answer: its rendering is not what was written
                return "the template rewrites the answer's own text"
        n = len(roles) - (0 if prompt_only else 1)
        msgs = self._messages(roles[:n], reasoning[:n], lambda i, f: values[2 * i + (f == "r")])
        try:
            seen = self.render(msgs, True)
        except Exception as e:
            return f"chat template failed: {type(e).__name__}: {e}"
        # Encoded as a server encodes the prompt it rendered (special tokens parsed): what the model saw.
        prompt = tuple(self.tok(seen, add_special_tokens=False)["input_ids"])
        head = (((FIXED, prompt),), False)
        if prompt_only:
            return _Plan((head,), ()), values
        return _Plan((head, plan.pieces[-1]), plan.fills), values

    def keeps_history(self, messages: Sequence[dict[str, Any]], answer: Answer) -> bool:
        """Whether every assistant turn of this conversation renders in the final conversation exactly as it did
        when it was the turn being written (the template keeps the history verbatim: ChatML does; Kimi K2.5 and
        Qwen3 drop earlier reasoning), for a template proven to write texts verbatim. Then one row with every
        assistant turn trained equals what the model saw at each turn."""
        if self.verbatim_problem is not None:
            return False
        try:
            roles, reasoning = self._shape(messages, answer)
            last = len(roles) - 1
            nonempty = tuple(
                k for k, v in (((last, "c"), answer.content), ((last, "r"), answer.reasoning)) if v
            )
            self._plan(roles, reasoning, (answer.finished, nonempty), True)
        except Exception:
            return False
        return True

    def tokenize(
        self, conversations: Sequence[tuple[Sequence[dict[str, Any]], Answer | None]], train_all: bool = False
    ) -> list[TokenizedConversation | TemplateError]:
        """Tokenize many conversations in one batch; a conversation that cannot be rendered yields its error."""
        planned: list[tuple[_Plan, list[str]] | TemplateError] = []
        to_verify: list[tuple[int, tuple, tuple, list[str], bool]] = []
        for row, (messages, answer) in enumerate(conversations):
            try:
                roles, reasoning = self._shape(messages, answer)
                values = self._values(messages, answer)
                ans_key = None
                if answer is not None:
                    last = len(roles) - 1
                    nonempty = tuple(
                        k for k, v in (((last, "c"), answer.content), ((last, "r"), answer.reasoning)) if v
                    )
                    ans_key = (answer.finished, nonempty)
                plan = self._plan(roles, reasoning, ans_key, train_all)
            except TemplateError as e:
                planned.append(e)
                continue
            except Exception as e:  # a template that raises on this input
                planned.append(TemplateError(f"chat template failed: {type(e).__name__}: {e}"))
                continue
            planned.append((plan, values))
            to_verify.append((row, roles, reasoning, values, answer is None))
        for row, err in self._verify(to_verify).items():
            entry = planned[row]
            if train_all or isinstance(entry, TemplateError) or not isinstance(err, TextRewritten):
                # Not rebuilt: a row that trains every turn (each earlier turn was written after a prompt of its
                # own, which one rendering cannot give), or a template that fails on the row.
                planned[row] = err
                continue
            rebuilt = self._rebuild(entry, to_verify, row)
            planned[row] = TextRewritten(f"{rebuilt}; {err}") if isinstance(rebuilt, str) else rebuilt
        texts: list[str] = []
        at_start: list[bool] = []
        for entry in planned:
            if isinstance(entry, TemplateError):
                continue
            plan, values = entry
            for fmt, refs, strip_right, strip_left, first in plan.fills:
                texts.append(_strip(fmt.format(*[values[i] for i in refs]), strip_left, strip_right))
                at_start.append(first)
        encoded = self.encoder.encode_texts(texts, at_start)
        # The ids of the whole batch are spliced into one list and converted to arrays once, not twice per
        # conversation; each conversation's arrays are views of them.
        ids: list[int] = []
        run_lengths: list[int] = []
        run_trained: list[bool] = []
        # Per conversation: (begin, end, answer start) in the batch's ids, or its error.
        spans: list[tuple[int, int, int] | TemplateError] = []
        t = 0
        for entry in planned:
            if isinstance(entry, TemplateError):
                spans.append(entry)
                continue
            plan = entry[0]
            begin = answer_start = len(ids)
            for pieces, trained in plan.pieces:
                start = len(ids)
                for kind, payload in pieces:
                    if kind == CONTROL:
                        ids.append(payload)
                    elif kind == FIXED:
                        ids.extend(payload)
                    else:
                        ids.extend(encoded[t + payload])
                run_lengths.append(len(ids) - start)
                run_trained.append(trained)
                if trained:
                    answer_start = start
            t += len(plan.fills)
            spans.append((begin, len(ids), answer_start if plan.pieces[-1][1] else len(ids)))
        all_ids = np.array(ids, dtype=np.int32)
        all_mask = np.repeat(np.array(run_trained, dtype=np.int8), run_lengths)
        return [
            s
            if isinstance(s, TemplateError)
            else TokenizedConversation(all_ids[s[0] : s[1]], all_mask[s[0] : s[1]], s[2] - s[0])
            for s in spans
        ]

    def prompt_ids(self, prompts: Sequence[Sequence[dict[str, Any]]]) -> list[list[int] | TemplateError]:
        """The generation prompt of each conversation, as the model must see it."""
        res = self.tokenize([(p, None) for p in prompts])
        return [r if isinstance(r, TemplateError) else r.input_ids.tolist() for r in res]
