"""The template plan: how one conversation shape's rendering is cut into pieces that conversations fill.

The template is rendered once per shape (`Shape`) with a sentinel in place of every message text. The
rendering is cut into control tokens (added-token strings the template itself wrote), fixed runs (template
text with no message text in it, encoded once when the plan is made) and runs to fill with each conversation's
own texts; regions say which pieces are trained. Tokenizing a batch is then: fill the runs, encode them in one
call, splice (`splice`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from .text_encoder import TextEncoder

if TYPE_CHECKING:
    from .answer import Answer

# Private-use characters no tokenizer writes: sentinel i c (i r) stands for message i's content (reasoning).
OPEN, CLOSE = "\ue000", "\ue001"
SENTINEL = re.compile(f"{OPEN}(\\d+)([cr]){CLOSE}")


def sentinel(message: int, field: str) -> str:
    return f"{OPEN}{message}{field}{CLOSE}"


def text_index(message: int, field: str) -> int:
    """Where message `message`'s content ("c") or reasoning ("r") sits in the flat texts (`flat_texts`)."""
    return 2 * message + (field == "r")


def flat_texts(messages: Sequence[dict[str, Any]], answer: Answer | None) -> list[str]:
    """The texts, flat: content0, reasoning0, content1, reasoning1, ... (reasoning "" where there is none)."""
    texts = [t for m in messages for t in (m["content"], m.get("reasoning") or "")]
    if answer is not None:
        texts += [answer.content or "", answer.reasoning or ""]
    return texts


def strip_run(text: str, left: bool, right: bool) -> str:
    if right:
        text = text.rstrip()
    if left:
        text = text.lstrip()
    return text


@dataclass(frozen=True, slots=True)
class FormatText:
    """Literal text with `{}` where message texts go, and the flat indices of those texts in order."""

    format: str
    refs: tuple[int, ...]

    @classmethod
    def of(cls, parts: Sequence[str | int]) -> FormatText:
        """From literal strings and flat text indices, in order (braces in the literals escaped)."""
        fmt = "".join("{}" if isinstance(p, int) else p.replace("{", "{{").replace("}", "}}") for p in parts)
        return cls(fmt, tuple(p for p in parts if isinstance(p, int)))

    @classmethod
    def of_sentinels(cls, text: str) -> FormatText:
        """A sentinel rendering with each sentinel turned into the place of the text it stands for."""
        literal = SENTINEL.split(text)[::3]  # the split keeps the two groups: every third part is text
        refs = [text_index(int(m.group(1)), m.group(2)) for m in SENTINEL.finditer(text)]
        return cls.of([p for pair in zip(literal, refs, strict=False) for p in pair] + [literal[-1]])

    def filled(self, texts: Sequence[str]) -> str:
        return self.format.format(*[texts[i] for i in self.refs])


@dataclass(frozen=True, slots=True)
class FillRun(FormatText):
    """A text run holding message texts, encoded per conversation. An added token with lstrip/rstrip absorbs
    the whitespace beside it when a whole text is encoded (Mistral's [/INST]), so the run gives that
    whitespace up."""

    strip_right: bool
    strip_left: bool
    at_start: bool  # the run opens the input (a Metaspace tokenizer adds its "▁" there only)

    def text(self, texts: Sequence[str]) -> str:
        # `filled` inlined: this runs once per run of every conversation tokenized
        return strip_run(
            self.format.format(*[texts[i] for i in self.refs]), self.strip_left, self.strip_right
        )


class PieceKind(Enum):
    CONTROL = "control"  # an added token the template wrote: its one id
    FIXED = "fixed"  # template text with no message text in it: its ids, encoded when the plan is made
    FILL = "fill"  # a run holding message text: the plan's `fills[fill]`, encoded per conversation


@dataclass(frozen=True, slots=True)
class Piece:
    kind: PieceKind
    ids: tuple[int, ...] = ()  # CONTROL and FIXED
    fill: int = 0  # FILL


@dataclass(frozen=True, slots=True)
class Region:
    """Consecutive pieces with one loss mask: a trained assistant turn, or the text between such turns."""

    pieces: tuple[Piece, ...]
    trained: bool


@dataclass(frozen=True, slots=True)
class TemplatePlan:
    regions: tuple[Region, ...]
    fills: tuple[FillRun, ...]


# Shape and AnswerShape are NamedTuples, not dataclasses: a shape is built, hashed and compared once per row
# tokenized (the plan cache's key), and a frozen dataclass makes that cost twice the tuple's.
class AnswerShape(NamedTuple):
    """The generated turn's part of a shape: where its written text ends depends on which texts it has."""

    finished: bool
    has_content: bool
    has_reasoning: bool


class Shape(NamedTuple):
    """What decides a conversation's plan besides its texts: the roles, which messages carry reasoning, and
    the generated turn (the last message), absent for a prompt alone."""

    roles: tuple[str, ...]
    reasoning: tuple[bool, ...]
    answer: AnswerShape | None

    @classmethod
    def of(cls, messages: Sequence[dict[str, Any]], answer: Answer | None) -> Shape:
        roles = tuple(m["role"] for m in messages)
        reasoning = tuple(bool(m.get("reasoning")) for m in messages)
        if answer is None:
            return cls(roles, reasoning, None)
        return cls(
            (*roles, "assistant"),
            (*reasoning, bool(answer.reasoning)),
            AnswerShape(answer.finished, bool(answer.content), bool(answer.reasoning)),
        )

    @property
    def prompt_only(self) -> bool:
        return self.answer is None


@dataclass(slots=True)
class PlannedRow:
    """A conversation of a batch with its plan and its flat texts."""

    index: int  # its place in the batch
    shape: Shape
    texts: list[str]
    plan: TemplatePlan


@dataclass(frozen=True, slots=True)
class _TextRun:
    parts: tuple[str | int, ...]  # literal strings and flat text indices, in order


def _is_control_in(item: int | _TextRun, ids: set[int]) -> bool:
    return not isinstance(item, _TextRun) and item in ids


class PlanCutter:
    """Cuts sentinel renderings into plans, with the target's control tokens and its text encoder."""

    def __init__(self, encoder: TextEncoder):
        self.encoder = encoder
        strings = sorted(encoder.control_ids, key=len, reverse=True)
        self.controls = re.compile("|".join(re.escape(s) for s in strings)) if strings else None

    def plan(self, text: str, trained: Sequence[tuple[int, int]]) -> TemplatePlan:
        """The plan of a sentinel rendering whose character spans `trained` (in order, not overlapping) are
        the trained turns."""
        regions: list[tuple[list[int | _TextRun], bool]] = []
        pos = 0
        for start, end in trained:
            if start > pos:
                regions.append((self._items(text[pos:start]), False))
            regions.append((self._items(text[start:end]), True))
            pos = end
        if pos < len(text) or not regions:
            regions.append((self._items(text[pos:]), False))
        return self._compile(regions)

    def _items(self, text: str) -> list[int | _TextRun]:
        """Control ids and text runs, in order: a run is what lies between two control tokens."""
        items: list[int | _TextRun] = []
        parts: list[str | int] = []

        def template_text(chunk: str) -> None:
            pos = 0
            if self.controls is not None:
                for m in self.controls.finditer(chunk):
                    if m.start() > pos:
                        parts.append(chunk[pos : m.start()])
                    if parts:
                        items.append(_TextRun(tuple(parts)))
                        parts.clear()
                    items.append(self.encoder.control_ids[m.group(0)])
                    pos = m.end()
            if pos < len(chunk):
                parts.append(chunk[pos:])

        pos = 0
        for m in SENTINEL.finditer(text):
            template_text(text[pos : m.start()])
            parts.append(text_index(int(m.group(1)), m.group(2)))
            pos = m.end()
        template_text(text[pos:])
        if parts:
            items.append(_TextRun(tuple(parts)))
        return items

    def _compile(self, regions: list[tuple[list[int | _TextRun], bool]]) -> TemplatePlan:
        """Items into pieces: runs without message text are encoded here, once per plan (a third to a half of
        all runs: the newlines and role names between control tokens), the others become runs to fill."""
        flat = [item for items, _ in regions for item in items]
        lstrip, rstrip = self.encoder.lstrip_ids, self.encoder.rstrip_ids
        out: list[Region] = []
        fills: list[FillRun] = []
        k = 0
        for items, trained in regions:
            pieces: list[Piece] = []
            for item in items:
                if not isinstance(item, _TextRun):
                    pieces.append(Piece(PieceKind.CONTROL, (item,)))
                    k += 1
                    continue
                strip_right = k + 1 < len(flat) and _is_control_in(flat[k + 1], lstrip)
                strip_left = k > 0 and _is_control_in(flat[k - 1], rstrip)
                run = FormatText.of(item.parts)
                if not run.refs:
                    text = strip_run("".join(map(str, item.parts)), strip_left, strip_right)
                    pieces.append(
                        Piece(PieceKind.FIXED, tuple(self.encoder.encode_texts([text], [k == 0])[0]))
                    )
                else:
                    pieces.append(Piece(PieceKind.FILL, fill=len(fills)))
                    fills.append(FillRun(run.format, run.refs, strip_right, strip_left, k == 0))
                k += 1
            out.append(Region(tuple(pieces), trained))
        return TemplatePlan(tuple(out), tuple(fills))


@dataclass(slots=True)
class Span:
    """One conversation's place in a spliced batch; its generated turn starts at `answer_start`."""

    begin: int
    end: int
    answer_start: int


@dataclass(frozen=True, slots=True)
class SplicedBatch:
    ids: np.ndarray  # int32, the conversations end to end
    mask: np.ndarray  # int8
    spans: list[Span]


def splice(plans: Sequence[TemplatePlan], encoded: Sequence[Sequence[int]]) -> SplicedBatch:
    """The ids of a batch: each plan's pieces in order, its runs to fill taken from `encoded` (every plan's
    fills, in order). Spliced into one list and converted to arrays once, not twice per conversation."""
    fill_kind = PieceKind.FILL
    ids: list[int] = []
    run_lengths: list[int] = []
    run_trained: list[bool] = []
    spans: list[Span] = []
    t = 0
    for plan in plans:
        begin = answer_start = len(ids)
        for region in plan.regions:
            start = len(ids)
            for piece in region.pieces:
                ids.extend(encoded[t + piece.fill] if piece.kind is fill_kind else piece.ids)
            run_lengths.append(len(ids) - start)
            run_trained.append(region.trained)
            if region.trained:
                answer_start = start
        t += len(plan.fills)
        spans.append(Span(begin, len(ids), answer_start if plan.regions[-1].trained else len(ids)))
    mask = np.repeat(np.array(run_trained, dtype=np.int8), run_lengths)
    return SplicedBatch(np.array(ids, dtype=np.int32), mask, spans)
