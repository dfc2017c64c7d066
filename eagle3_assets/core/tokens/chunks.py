"""One chunk of answered conversations -> token rows (ids, loss mask, reference comparison, answer features),
and the thread pool that tokenizes chunks in order while the caller reads and writes (the Rust encoding of one
chunk overlaps the Python of the next)."""

from __future__ import annotations

import functools
import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import polars as pl
import pyarrow as pa

from ..target_model.chat import Answer, ChatTokenizer, TemplateError, TokenizedConversation
from ..target_model.tool_calls import finished as is_finished
from ..target_model.tool_calls import parse_calls
from ..target_model.tool_render import tools_of
from .answer_quality import is_degenerate
from .reference import Comparison, compare, normalise_reference

# Per-answer text features the report counts, computed once when a row is tokenized (a top-up's report then
# reads small columns, not every answer's text again).
ANSWER_FEATURES: dict[str, pl.DataType] = {
    "answer_empty": pl.Boolean(),
    "answer_degenerate": pl.Boolean(),
    "answer_has_reasoning": pl.Boolean(),
}


TOKENS_ERRORS_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String(),
    "reason": pl.String(),
    "row_key": pl.UInt64(),
    **ANSWER_FEATURES,
}


@dataclass
class TokensSummary:
    n_rows: int = 0
    n_errors: int = 0
    n_reference: int = 0
    n_match: int = 0
    n_explained: int = 0
    mismatch_kinds: Counter = field(default_factory=Counter)
    ids_source: Counter = field(default_factory=Counter)
    n_tokens: int = 0
    n_loss_tokens: int = 0
    errors: Counter = field(default_factory=Counter)
    workers: int = 1
    n_tokenized: int = 0  # rows tokenized in this run (new or changed); the others were kept
    # Damaged earlier outputs moved to quarantine/ (Quarantined).
    set_aside: list = field(default_factory=list)

    @property
    def match_rate(self) -> float | None:
        return self.n_match / self.n_reference if self.n_reference else None

    def add(self, other: TokensSummary) -> None:
        for name in (
            "n_rows",
            "n_errors",
            "n_reference",
            "n_match",
            "n_explained",
            "n_tokens",
            "n_loss_tokens",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("mismatch_kinds", "ids_source", "errors"):
            getattr(self, name).update(getattr(other, name))

    def count(self, source: str, cmp: Comparison | None) -> None:
        """One written row: where its ids came from and how they compare with the model's."""
        self.ids_source[source] += 1
        if cmp is not None:
            self.n_reference += 1
            self.n_match += cmp.match
            self.n_explained += cmp.explained
            if cmp.kind:
                self.mismatch_kinds[cmp.kind] += 1


def _list_column(flat: np.ndarray, lengths: np.ndarray) -> pl.Series:
    """A list column from one flat buffer and the row lengths (no Python list per token)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    cls = pa.ListArray if offsets[-1] < 2**31 else pa.LargeListArray
    offsets = offsets.astype(np.int32) if cls is pa.ListArray else offsets
    return cast(pl.Series, pl.from_arrow(cls.from_arrays(pa.array(offsets), pa.array(flat))))


def tokenize_in_parallel(
    chunks: Iterator[pl.DataFrame],
    chat: ChatTokenizer,
    train_all: bool,
    prefer_reference: bool,
    n_workers: int,
) -> Iterator[TokenizedChunk]:
    """Chunks tokenized on n_workers threads, results in order, a few chunks in flight (bounded memory).

    Threads, not processes: the encoding is Rust and releases the GIL, so one chunk's Python work (template
    render, splicing, comparison) overlaps another chunk's encoding. Forked worker processes (which inherit
    the loaded tokenizer) were measured too: no faster on 2 cores, the pickling of chunks and results cost
    what the GIL did."""
    if n_workers <= 1:
        for chunk in chunks:
            yield tokenize_chunk(chunk, chat, train_all, prefer_reference)
        return
    with ThreadPoolExecutor(n_workers) as pool:
        yield from _map_in_order(
            pool,
            functools.partial(
                tokenize_chunk, chat=chat, train_all=train_all, prefer_reference=prefer_reference
            ),
            chunks,
            n_workers,
        )


def _map_in_order(pool: Executor, fn: Callable, items: Iterator, n_workers: int) -> Iterator:
    """fn over items on the pool, results in order, at most 2·n_workers in flight (bounded memory)."""
    pending: deque = deque()
    for item in itertools.islice(items, 2 * n_workers):
        pending.append(pool.submit(fn, item))
    while pending:
        result = pending.popleft().result()
        nxt = next(items, None)
        if nxt is not None:
            pending.append(pool.submit(fn, nxt))
        yield result


TOKENS_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String(),
    "input_ids": pl.List(pl.Int32()),
    "loss_mask": pl.List(pl.Int8()),
    "reference_match": pl.Boolean(),
    "match_explained": pl.Boolean(),
    "n_tokens": pl.Int32(),
    "n_loss_tokens": pl.Int32(),
    "answer_start": pl.Int32(),
    "ids_source": pl.String(),
    "mismatch": pl.String(),
    "first_diff": pl.Int32(),
    "finish_reason": pl.String(),
    "row_key": pl.UInt64(),  # content key of the prompt + answer (+ tokenizer): unchanged rows are not redone
    **ANSWER_FEATURES,
    # turns: all: a conversation row (`<id>#t<K>`, loss on every target turn 1..K) rather than one turn's row.
    # A file without this column reads it as null: not a conversation row.
    "all_turns": pl.Boolean(),
}


def answer_features(content: str | None, reasoning: str | None, n_calls: int = 0) -> dict[str, bool]:
    return {
        "answer_empty": not (content or "").strip() and not n_calls,  # a call is an answer
        "answer_degenerate": is_degenerate((reasoning or "") + (content or "")),
        "answer_has_reasoning": bool(reasoning and reasoning.strip()),
    }


@dataclass
class TokenizedChunk:
    """What one chunk gives: rows for both tables and its counts."""

    frame: pl.DataFrame  # its rows of tokens.parquet (TOKENS_SCHEMA)
    errors: list[dict]  # its rows of tokens_errors.parquet (TOKENS_ERRORS_SCHEMA)
    summary: TokensSummary


def tokenize_chunk(
    chunk: pl.DataFrame, chat: ChatTokenizer, train_all: bool, prefer_reference: bool
) -> TokenizedChunk:
    """One chunk of joined prompt + response rows -> its tokens rows, its error rows and its counts."""
    rows = _ChunkRows.of(chunk)
    finished = [is_finished(f) for f in rows.finish_reason]
    convs = [
        (m, Answer(c or "", r, fin, tuple(parse_calls(t))))
        for m, c, r, fin, t in zip(
            rows.messages, rows.content, rows.reasoning, finished, rows.tool_calls, strict=True
        )
    ]
    tools = [tools_of(t) for t in rows.tools]
    results = _tokenize_rows(chat, convs, [train_all or bool(a) for a in rows.all_turns], tools)
    features = [answer_features(a.content, a.reasoning, len(a.tool_calls)) for _, a in convs]
    stop_ids = chat.stop_ids
    summary = TokensSummary()
    table = _TokenTable()
    errors: list[dict] = []
    for i, res in enumerate(results):
        if isinstance(res, TemplateError):
            errors.append({"id": rows.id[i], "reason": str(res), "row_key": rows.row_key[i], **features[i]})
            summary.errors[str(res)[:80]] += 1
            continue
        resolved = _resolve_row(res, rows.output_ids[i], finished[i], chat, stop_ids, prefer_reference)
        history = rows.history_refs[i]
        if history:
            resolved.comparison = _with_history(resolved.comparison, res, history, chat, stop_ids)
        table.add(resolved, rows, i, res.answer_start, features[i])
        summary.count(resolved.source, resolved.comparison)
    summary.n_errors = len(errors)
    return TokenizedChunk(table.frame(summary), errors, summary)


@dataclass
class _ChunkRows:
    """A chunk's input columns as Python lists, row i of each belonging together."""

    id: list[str]
    messages: list[list[dict]]
    content: list[str | None]
    reasoning: list[str | None]
    finish_reason: list[str | None]
    output_ids: list[list[int] | None]
    row_key: list[int | None]
    all_turns: list[bool | None]  # a conversation row (`turns: all`): every assistant turn trained
    history_refs: list[list[dict] | None]  # a conversation row's earlier turns' produced ids
    tools: list[str | None]  # the prompt's tool definitions (compact JSON), None without
    tool_calls: list[str | None]  # the answer's calls (canonical JSON), None without

    @classmethod
    def of(cls, chunk: pl.DataFrame) -> _ChunkRows:
        def optional(name: str, default: Any) -> list:
            return chunk[name].to_list() if name in chunk.columns else [default] * chunk.height

        return cls(
            id=chunk["id"].to_list(),
            messages=chunk["messages"].to_list(),
            content=chunk["content"].to_list(),
            reasoning=chunk["reasoning"].to_list(),
            finish_reason=chunk["finish_reason"].to_list(),
            output_ids=chunk["output_ids"].to_list(),
            row_key=optional("row_key", None),
            all_turns=optional("all_turns", False),
            history_refs=optional("history_refs", None),
            tools=optional("tools", None),
            tool_calls=optional("tool_calls", None),
        )


@dataclass
class _ResolvedRow:
    """A row's ids as written (rebuilt or the model's own: `source`) and how they compare with the model's."""

    input_ids: np.ndarray
    loss_mask: np.ndarray
    source: str  # "reconstructed" | "reference"
    comparison: Comparison | None  # None: no reference ids to compare with


# Columns filled row by row; the ids, the masks and their counts are built from flat arrays at the end.
_LIST_COLUMNS = [k for k in TOKENS_SCHEMA if k not in ("input_ids", "loss_mask", "n_tokens", "n_loss_tokens")]


class _TokenTable:
    """The token rows of a chunk as they are added, turned into one frame at the end."""

    def __init__(self) -> None:
        self.ids: list[np.ndarray] = []
        self.masks: list[np.ndarray] = []
        self.columns: dict[str, list] = {k: [] for k in _LIST_COLUMNS}

    def add(
        self, row: _ResolvedRow, rows: _ChunkRows, i: int, answer_start: int, features: dict[str, bool]
    ) -> None:
        cmp, out = row.comparison, self.columns
        self.ids.append(row.input_ids)
        self.masks.append(row.loss_mask)
        out["id"].append(rows.id[i])
        out["reference_match"].append(None if cmp is None else cmp.match)
        out["match_explained"].append(None if cmp is None else cmp.explained)
        out["ids_source"].append(row.source)
        out["mismatch"].append(None if cmp is None else cmp.kind)
        out["first_diff"].append(None if cmp is None else cmp.first_diff)
        out["answer_start"].append(answer_start)
        out["finish_reason"].append(rows.finish_reason[i])
        out["row_key"].append(rows.row_key[i])
        out["all_turns"].append(bool(rows.all_turns[i]))
        for name, value in features.items():
            out[name].append(value)

    def frame(self, summary: TokensSummary) -> pl.DataFrame:
        """The rows as a TOKENS_SCHEMA frame; their row, token and loss-token totals go to `summary`."""
        # Per-row counts once; the summary's totals are their sums.
        n_tokens = np.fromiter((len(a) for a in self.ids), dtype=np.int32, count=len(self.ids))
        n_loss = np.fromiter((int(m.sum()) for m in self.masks), dtype=np.int32, count=len(self.masks))
        summary.n_rows = len(self.columns["id"])
        summary.n_tokens, summary.n_loss_tokens = int(n_tokens.sum()), int(n_loss.sum())
        flat_ids = np.concatenate(self.ids) if self.ids else np.zeros(0, np.int32)
        flat_mask = np.concatenate(self.masks) if self.masks else np.zeros(0, np.int8)
        arrays = {
            "input_ids": _list_column(flat_ids.astype(np.int32, copy=False), n_tokens),
            "loss_mask": _list_column(flat_mask.astype(np.int8, copy=False), n_tokens),
            "n_tokens": pl.Series(n_tokens, dtype=pl.Int32),
            "n_loss_tokens": pl.Series(n_loss, dtype=pl.Int32),
        }
        return pl.DataFrame(
            {
                name: arrays[name] if name in arrays else pl.Series(self.columns[name], dtype=dtype)
                for name, dtype in TOKENS_SCHEMA.items()
            }
        )


def _tokenize_rows(
    chat: ChatTokenizer,
    convs: list[tuple[Any, Answer]],
    train_all: list[bool],
    tools: list[list[dict] | None],
) -> list[TokenizedConversation | TemplateError]:
    """One tokenize call per training mode (a conversation row of `turns: all` trains every turn)."""
    out: list[Any] = [None] * len(convs)
    for mode in (False, True):
        idx = [i for i, t in enumerate(train_all) if t is mode]
        if idx:
            batch = chat.tokenize([convs[i] for i in idx], train_all=mode, tools=[tools[i] for i in idx])
            for i, res in zip(idx, batch, strict=True):
                out[i] = res
    return out


def _with_history(
    last: Comparison | None,
    res: TokenizedConversation,
    history: list[dict],
    chat: ChatTokenizer,
    stop_ids: set[int],
) -> Comparison | None:
    """A conversation row's earlier turns against the ids the model produced for each: the k-th trained span
    of the row is turn k. The row matches when every turn with reference ids does; the first that does not
    says why."""
    spans = _trained_spans(res.loss_mask)
    verdicts = []
    for (a, b), h in zip(spans[: len(history)], history, strict=False):
        if h["output_ids"] is None:
            continue
        reference = normalise_reference(list(h["output_ids"]), h["finished"], chat.eot_id, stop_ids)
        verdicts.append(
            compare(res.input_ids[a:b], reference, chat.encoder.decode, h["finished"], _canonical(chat))
        )
    if last is not None:
        verdicts.append(last)
    if not verdicts:
        return None
    return next((v for v in verdicts if not v.match), verdicts[-1])


def _canonical(chat: ChatTokenizer) -> Callable[[list[int]], list[int]]:
    """The tokenizer's own ids for a reference's text as it stands in a turn (after a control token, so no
    leading-space marker is added; its end-of-turn id kept as an id)."""

    def encode(reference: list[int]) -> list[int]:
        eot = chat.eot_id
        body = reference[:-1] if reference and reference[-1] == eot else reference
        text = chat.encoder.decode(list(body))
        ids = chat.tok(chat.eot_token + text, add_special_tokens=False)["input_ids"][1:]
        return [*ids, eot] if eot is not None and len(body) < len(reference) else ids

    return encode


def _trained_spans(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def _resolve_row(
    res: TokenizedConversation,
    ref: list[int] | None,
    finished: bool,
    chat: ChatTokenizer,
    stop_ids: set[int],
    prefer_reference: bool,
) -> _ResolvedRow:
    if ref is None:
        return _ResolvedRow(res.input_ids, res.loss_mask, "reconstructed", None)
    reference = normalise_reference(list(ref), finished, chat.eot_id, stop_ids)
    cmp = compare(res.answer_ids, reference, chat.encoder.decode, finished, _canonical(chat))
    if cmp.match or not prefer_reference:
        return _ResolvedRow(
            res.input_ids, res.loss_mask, "reconstructed" if not cmp.match else "reference", cmp
        )
    head = res.input_ids[: res.answer_start]
    ids = np.concatenate([head, np.asarray(reference, dtype=np.int32)])
    mask = np.concatenate([res.loss_mask[: res.answer_start], np.ones(len(reference), dtype=np.int8)])
    return _ResolvedRow(ids, mask, "reference", cmp)
