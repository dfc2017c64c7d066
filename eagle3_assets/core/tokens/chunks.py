"""One chunk of answered conversations -> token rows (ids, loss mask, reference comparison, answer features), and
the thread pool that tokenizes chunks in order while the caller reads and writes (the Rust encoding of one chunk
overlaps the Python of the next)."""

from __future__ import annotations

import functools
import itertools
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from ..target.chat import Answer, ChatTokenizer, TemplateError, TokenizedConversation
from .answer_quality import is_degenerate
from .reference import Comparison, compare, normalise_reference

# Per-answer text features the report counts, computed once when a row is tokenized (a top-up's report then reads
# small columns, not every answer's text again).
ANSWER_FEATURES = {
    "answer_empty": pl.Boolean,
    "answer_degenerate": pl.Boolean,
    "answer_has_reasoning": pl.Boolean,
}


TOKENS_ERRORS_SCHEMA = {"id": pl.String, "reason": pl.String, "row_key": pl.UInt64, **ANSWER_FEATURES}


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


def _list_column(flat: np.ndarray, lengths: np.ndarray) -> pl.Series:
    """A list column from one flat buffer and the row lengths (no Python list per token)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    cls = pa.ListArray if offsets[-1] < 2**31 else pa.LargeListArray
    offsets = offsets.astype(np.int32) if cls is pa.ListArray else offsets
    return pl.from_arrow(cls.from_arrays(pa.array(offsets), pa.array(flat)))


def tokenize_in_parallel(
    chunks: Iterator[pl.DataFrame],
    chat: ChatTokenizer,
    train_all: bool,
    prefer_reference: bool,
    n_workers: int,
) -> Iterator[tuple[pl.DataFrame, list[dict], TokensSummary]]:
    """Chunks tokenized on n_workers threads, results in order, a few chunks in flight (bounded memory).

    Threads, not processes: the encoding is Rust and releases the GIL, so one chunk's Python work (template render,
    splicing, comparison) overlaps another chunk's encoding. Forked worker processes (which inherit the loaded
    tokenizer) were measured too: no faster on 2 cores, the pickling of chunks and results cost what the GIL did."""
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
    "id": pl.String,
    "input_ids": pl.List(pl.Int32),
    "loss_mask": pl.List(pl.Int8),
    "reference_match": pl.Boolean,
    "match_explained": pl.Boolean,
    "n_tokens": pl.Int32,
    "n_loss_tokens": pl.Int32,
    "answer_start": pl.Int32,
    "ids_source": pl.String,
    "mismatch": pl.String,
    "first_diff": pl.Int32,
    "finish_reason": pl.String,
    "row_key": pl.UInt64,  # content key of the prompt + answer (+ tokenizer): unchanged rows are not redone
    **ANSWER_FEATURES,
    # turns: all: a conversation row (`<id>#t<K>`, loss on every target turn 1..K) rather than one turn's row.
    # Files written before this column read it as null: not a conversation row.
    "all_turns": pl.Boolean,
}


def answer_features(content: str | None, reasoning: str | None) -> dict[str, bool]:
    return {
        "answer_empty": not (content or "").strip(),
        "answer_degenerate": is_degenerate((reasoning or "") + (content or "")),
        "answer_has_reasoning": bool(reasoning and reasoning.strip()),
    }


def tokenize_chunk(
    chunk: pl.DataFrame, chat: ChatTokenizer, train_all: bool, prefer_reference: bool
) -> tuple[pl.DataFrame, list[dict], TokensSummary]:
    """One chunk of joined prompt + response rows -> its tokens rows, its error rows and its counts."""
    rows = {
        c: chunk[c].to_list()
        for c in ("id", "messages", "content", "reasoning", "finish_reason", "output_ids")
    }
    rows["row_key"] = chunk["row_key"].to_list() if "row_key" in chunk.columns else [None] * chunk.height
    all_turns = chunk["all_turns"].to_list() if "all_turns" in chunk.columns else [False] * chunk.height
    history_refs = (
        chunk["history_refs"].to_list() if "history_refs" in chunk.columns else [None] * chunk.height
    )
    stop_ids = chat.stop_ids
    summary = TokensSummary()
    out: dict[str, list] = {
        k: [] for k in TOKENS_SCHEMA if k not in ("input_ids", "loss_mask", "n_tokens", "n_loss_tokens")
    }
    arrays: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    errors: list[dict] = []
    reasons = rows["finish_reason"]
    finished = [f == "stop" for f in reasons]
    convs = [
        (m, Answer(c or "", r, fin))
        for m, c, r, fin in zip(rows["messages"], rows["content"], rows["reasoning"], finished, strict=True)
    ]
    results = _tokenize_rows(chat, convs, [train_all or bool(a) for a in all_turns])
    features = [answer_features(a.content, a.reasoning) for _, a in convs]
    for pid, res, ref, fin, fr, key, feats, history, whole in zip(
        rows["id"], results, rows["output_ids"], finished, reasons, rows["row_key"], features, history_refs,
        all_turns, strict=True,
    ):  # fmt: skip
        if isinstance(res, TemplateError):
            errors.append({"id": pid, "reason": str(res), "row_key": key, **feats})
            summary.errors[str(res)[:80]] += 1
            continue
        input_ids, mask, source, cmp = _resolve_row(res, ref, fin, chat, stop_ids, prefer_reference)
        if history:
            cmp = _with_history(cmp, res, history, chat, stop_ids)
        out["id"].append(pid)
        arrays.append(input_ids)
        masks.append(mask)
        out["reference_match"].append(None if cmp is None else cmp.match)
        out["match_explained"].append(None if cmp is None else cmp.explained)
        out["ids_source"].append(source)
        out["mismatch"].append(None if cmp is None else cmp.kind)
        out["first_diff"].append(None if cmp is None else cmp.first_diff)
        out["answer_start"].append(res.answer_start)
        out["finish_reason"].append(fr)
        out["row_key"].append(key)
        out["all_turns"].append(bool(whole))
        for name, value in feats.items():
            out[name].append(value)
        summary.ids_source[source] += 1
        if cmp is not None:
            summary.n_reference += 1
            summary.n_match += cmp.match
            summary.n_explained += cmp.explained
            if cmp.kind:
                summary.mismatch_kinds[cmp.kind] += 1
    # Per-row counts once; the summary's totals are their sums.
    n_tokens = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays))
    n_loss = np.fromiter((int(m.sum()) for m in masks), dtype=np.int32, count=len(masks))
    summary.n_rows = len(out["id"])
    summary.n_tokens, summary.n_loss_tokens = int(n_tokens.sum()), int(n_loss.sum())
    summary.n_errors = len(errors)
    flat_ids = np.concatenate(arrays) if arrays else np.zeros(0, np.int32)
    flat_mask = np.concatenate(masks) if masks else np.zeros(0, np.int8)
    columns = {
        "input_ids": _list_column(flat_ids.astype(np.int32, copy=False), n_tokens),
        "loss_mask": _list_column(flat_mask.astype(np.int8, copy=False), n_tokens),
        "n_tokens": pl.Series(n_tokens, dtype=pl.Int32),
        "n_loss_tokens": pl.Series(n_loss, dtype=pl.Int32),
    }
    df = pl.DataFrame(
        {
            name: columns[name] if name in columns else pl.Series(out[name], dtype=dtype)
            for name, dtype in TOKENS_SCHEMA.items()
        }
    )
    return df, errors, summary


def _tokenize_rows(
    chat: ChatTokenizer, convs: list[tuple[Any, Answer]], train_all: list[bool]
) -> list[TokenizedConversation | TemplateError]:
    """One tokenize call per training mode (a conversation row of `turns: all` trains every turn)."""
    out: list[Any] = [None] * len(convs)
    for mode in (False, True):
        idx = [i for i, t in enumerate(train_all) if t is mode]
        if idx:
            for i, res in zip(idx, chat.tokenize([convs[i] for i in idx], train_all=mode), strict=True):
                out[i] = res
    return out


def _with_history(
    last: Comparison | None,
    res: TokenizedConversation,
    history: list[dict],
    chat: ChatTokenizer,
    stop_ids: set[int],
) -> Comparison | None:
    """A conversation row's earlier turns against the ids the model produced for each: the k-th trained span of
    the row is turn k. The row matches when every turn with reference ids does; the first that does not says why."""
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
        return [*ids, eot] if len(body) < len(reference) else ids

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
) -> tuple[np.ndarray, np.ndarray, str, Comparison | None]:
    if ref is None:
        return res.input_ids, res.loss_mask, "reconstructed", None
    reference = normalise_reference(list(ref), finished, chat.eot_id, stop_ids)
    cmp = compare(res.answer_ids, reference, chat.encoder.decode, finished, _canonical(chat))
    if cmp.match or not prefer_reference:
        return res.input_ids, res.loss_mask, "reconstructed" if not cmp.match else "reference", cmp
    head = res.input_ids[: res.answer_start]
    ids = np.concatenate([head, np.asarray(reference, dtype=np.int32)])
    mask = np.concatenate([res.loss_mask[: res.answer_start], np.ones(len(reference), dtype=np.int8)])
    return ids, mask, "reference", cmp
