"""tokens: every answered conversation as `input_ids` + `loss_mask`, checked against the ids the model produced.

Where a backend returned its output ids (embedded model, SGLang, imported data) those are ground truth: the row
keeps them (unless configured otherwise) and `reference_match` says whether the reconstruction from text gave the
same ids. Text-only answers (OpenRouter) get the reconstruction, `reference_match` null.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from .chat_tokens import Answer, ChatTokenizer, TemplateError, TokenizedConversation
from .files import atomic_write, available_cores, write_parquet
from .layout import DatasetLayout
from .parquet_append import append_file
from .report import is_degenerate
from .store import RESPONSE_SCHEMA, JournalTable
from .versions import file_version

# Per-answer text features the report counts, computed once when a row is tokenized (a top-up's report then reads
# small columns, not every answer's text again).
ANSWER_FEATURES = {
    "answer_empty": pl.Boolean,
    "answer_degenerate": pl.Boolean,
    "answer_has_reasoning": pl.Boolean,
}
TOKENS_ERRORS_SCHEMA = {"id": pl.String, "reason": pl.String, "row_key": pl.UInt64, **ANSWER_FEATURES}


TAIL_TOKENS = 3  # a truncated answer's last pre-token may merge differently once the text is cut


@dataclass
class Comparison:
    match: bool
    # None | "truncation_tail" (a cut answer's last tokens) | "invalid_utf8" (bytes text cannot carry) |
    # "bpe_split" (same text, other ids) | "text_differs"
    kind: str | None = None
    first_diff: int | None = None

    @property
    def explained(self) -> bool:
        """Matches, or differs only where text cannot say which ids were produced (the cut of a truncated answer)."""
        return self.match or self.kind == "truncation_tail"


def normalise_reference(ids: list[int], finished: bool, eot_id: int | None, stop_ids: set[int]) -> list[int]:
    """Server output ids as the template would close them: a finished answer ends with the end-of-turn id."""
    if finished and eot_id is not None:
        if ids and ids[-1] in stop_ids and ids[-1] != eot_id:
            return [*ids[:-1], eot_id]  # stopped on another stop id (e.g. eos): the turn still ends with eot
        if not ids or ids[-1] != eot_id:
            return [*ids, eot_id]
    return ids


def compare(
    reconstructed: np.ndarray, reference: list[int], decode: Callable[[list[int]], str], finished: bool = True
) -> Comparison:
    ref = np.asarray(reference, dtype=np.int32)
    if reconstructed.shape == ref.shape and np.array_equal(reconstructed, ref):
        return Comparison(True)
    n = min(len(ref), len(reconstructed))
    diff = np.flatnonzero(reconstructed[:n] != ref[:n])
    first = int(diff[0]) if diff.size else n
    if not finished and first >= len(ref) - TAIL_TOKENS:
        return Comparison(False, "truncation_tail", first)
    ref_text = decode(reference)
    if "\ufffd" in decode(reference[first:]):
        return Comparison(False, "invalid_utf8", first)
    same_text = decode(reconstructed.tolist()) == ref_text
    return Comparison(False, "bpe_split" if same_text else "text_differs", first)


def _list_column(flat: np.ndarray, lengths: np.ndarray) -> pl.Series:
    """A list column from one flat buffer and the row lengths (no Python list per token)."""
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    cls = pa.ListArray if offsets[-1] < 2**31 else pa.LargeListArray
    offsets = offsets.astype(np.int32) if cls is pa.ListArray else offsets
    return pl.from_arrow(cls.from_arrays(pa.array(offsets), pa.array(flat)))


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


def row_keys(rows: pl.DataFrame, fingerprint: str) -> pl.DataFrame:
    """A content key per row: the prompt, the answer, its reference ids, and the tokenizer and options that turn
    them into ids. A row whose key is unchanged is never tokenized again. (polars' hash may change between polars
    versions; the version is part of the fingerprint, so an upgrade re-tokenizes once rather than trusting it.)"""
    parts = [
        pl.col("messages").list.eval(pl.element().struct.json_encode()).list.join("\x1e"),
        pl.col("content").fill_null(""),
        pl.col("reasoning").fill_null("\x00"),
        pl.col("finish_reason").fill_null(""),
        pl.col("output_ids").cast(pl.List(pl.String)).list.join(",").fill_null("-"),
        pl.lit(f"{fingerprint}|polars {pl.__version__}"),
    ]
    return rows.with_columns(pl.concat_str(parts, separator="\x1f").hash(seed=7).alias("row_key"))


PROGRESS_EVERY_S = 10.0
RESPONSE_COLUMNS = ["id", "content", "reasoning", "finish_reason", "output_ids"]


def response_batches(
    layout: DatasetLayout, batch_size: int, parts: list[str] | None = None, seen: set[str] | None = None
) -> Iterator[pl.DataFrame]:
    """The stored answers, one row per id (the first stored wins, as everywhere), a batch at a time: memory holds
    one batch of text, never the partition. `parts`: only these journal files; `seen`: ids to skip."""
    table = JournalTable(layout.responses_dir, RESPONSE_SCHEMA)
    seen = set() if seen is None else seen
    for path in table.files():
        if parts is not None and path.name not in parts:
            continue
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
            df = pl.from_arrow(batch)
            for name in RESPONSE_COLUMNS:  # parts from older versions may lack a column
                if name not in df.columns:
                    df = df.with_columns(pl.lit(None, dtype=RESPONSE_SCHEMA[name]).alias(name))
            df = df.select(RESPONSE_COLUMNS)
            # Repeated ids are rare: checking costs a hash of the ids, de-duplicating a copy of the batch.
            if df["id"].is_duplicated().any():
                df = df.unique(subset=["id"], keep="first", maintain_order=True)
            ids = df["id"].to_list()
            # A set lookup per row: filtering by a Series of every id seen so far would be O(n^2).
            fresh = [i not in seen for i in ids]
            if not all(fresh):
                df = df.filter(pl.Series(fresh, dtype=pl.Boolean))
            seen.update(ids)
            if df.height:
                yield df


def build_tokens(
    layout: DatasetLayout,
    chat: ChatTokenizer,
    train_all: bool = False,
    prefer_reference: bool = True,
    batch_size: int = 512,
    log: Callable[[str], None] = print,
    workers: int | None = None,
) -> TokensSummary:
    """Tokenize the answered conversations that are new or changed since tokens.parquet was written, keep the rest
    as they are, and write tokens.parquet and tokens_errors.parquet again, streaming: a top-up of 1,000 answers to a
    partition of 200,000 tokenizes 1,000 and copies the others, and memory holds a few batches, not the partition.

    Chunks are tokenized on a thread per core (`tokenize_in_parallel`) while this thread reads, hashes and writes.
    """
    fingerprint = f"{chat.fingerprint()}|train_all={train_all}|prefer_reference={prefer_reference}"
    prompts = pl.read_parquet(layout.prompts, columns=["id", "messages"])
    old_tokens = _scan_with_keys(layout.tokens, TOKENS_SCHEMA)
    old_errors = _scan_with_keys(layout.tokens_errors, TOKENS_ERRORS_SCHEMA)
    old_keys = old_tokens.select("id", "row_key").collect()
    done = pl.concat([old_keys, old_errors.select("id", "row_key").collect()])
    current: list[pl.DataFrame] = []  # (id, row_key) of every row now: small
    counter = {"todo": 0, "done": 0, "next_log": time.monotonic() + PROGRESS_EVERY_S}
    # Journal parts are immutable: when the prompts and the tokenizer are as they were and every part the last
    # build read is still there, only the parts added since can hold new rows (a top-up reads 1,000 answers, not
    # the partition's); anything else (a compaction, new prompts, another template) re-keys every row.
    state = {
        "fingerprint": fingerprint,
        "prompts": file_version(layout.prompts),
        "parts": [p.name for p in JournalTable(layout.responses_dir, RESPONSE_SCHEMA).files()],
    }
    last = _recorded_state(layout.tokens)
    appended = (
        last is not None
        and layout.tokens_errors.exists()
        and last["fingerprint"] == fingerprint
        and last["prompts"] == state["prompts"]
        and set(last["parts"]) <= set(state["parts"])
    )

    def todo_chunks() -> Iterator[pl.DataFrame]:
        if appended:
            new_parts = [p for p in state["parts"] if p not in set(last["parts"])]
            for batch in response_batches(layout, batch_size, new_parts, set(done["id"].to_list())):
                rows = row_keys(prompts.join(batch, on="id", how="inner"), fingerprint)
                counter["todo"] += rows.height
                if rows.height:
                    yield rows
            return
        for batch in response_batches(layout, batch_size):
            rows = row_keys(prompts.join(batch, on="id", how="inner"), fingerprint)
            current.append(rows.select("id", "row_key"))
            todo = rows.join(done, on=["id", "row_key"], how="anti")
            counter["todo"] += todo.height
            if todo.height:
                yield todo

    scratch = layout.dir / f".tokens-{time.time_ns()}"
    scratch.mkdir(parents=True, exist_ok=True)
    errors: list[dict] = []
    try:

        def results() -> Iterator[pl.DataFrame]:
            n = workers or available_cores()
            for df, errs, _part in tokenize_in_parallel(todo_chunks(), chat, train_all, prefer_reference, n):
                errors.extend(errs)
                counter["done"] += df.height + len(errs)
                if time.monotonic() >= counter["next_log"]:
                    # Every few seconds, not every chunk: in Dagster each line is an event written to the
                    # instance's database (a line per 512 rows cost a 20M-token step ~10% of its time).
                    counter["next_log"] = time.monotonic() + PROGRESS_EVERY_S
                    log(f"tokens: {counter['done']:,} new or changed conversations tokenized")
                yield df

        new = scratch / "new.parquet"
        _write_chunks(new, results(), metadata={STATE_KEY: json.dumps(state)})
        keys = (
            None  # every earlier row stands
            if appended
            else pl.concat(current)
            if current
            else pl.DataFrame(schema={"id": pl.String, "row_key": pl.UInt64})
        )
        stale = keys is not None and old_keys.join(keys, on=["id", "row_key"], how="anti").height > 0
        unchanged = counter["todo"] == 0 and (keys is None or done.height == keys.height)
        if unchanged and layout.tokens.exists() and last == state:
            # Every current row is already written and nothing written is stale: the outputs stand as they are.
            summary = summarize(layout)
            summary.workers = workers or available_cores()
            return summary
        # No earlier token row is stale (a top-up, or nothing new after a compaction): the new rows (maybe none;
        # the file then gets the new state, so the next top-up reads only new parts again) are appended.
        _place_tokens(layout.tokens, new, keys if stale else None, batch_size, {STATE_KEY: json.dumps(state)})
        new_errors = pl.DataFrame(errors, schema=TOKENS_ERRORS_SCHEMA)
        kept_errors = list(_kept_batches(layout.tokens_errors, keys, TOKENS_ERRORS_SCHEMA, batch_size))
        write_parquet(pl.concat([*kept_errors, new_errors], how="vertical_relaxed"), layout.tokens_errors)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(layout)
    summary.n_tokenized = counter["todo"]
    summary.workers = workers or available_cores()
    return summary


def _place_tokens(
    path: Path, new: Path, keys: pl.DataFrame | None, batch_size: int, metadata: dict[str, str]
) -> None:
    """tokens.parquet = the earlier rows still current + the new rows (`new`, written with the final metadata).

    Every earlier row stands (`keys` None, a top-up): the new row groups are appended to the file's bytes, nothing
    old is decoded (a 1,000-row top-up of a 200k-row file costs a file copy, not a re-encode of gigabytes). No
    earlier file: `new` is the file. Some earlier rows are stale (a re-key): the kept rows are re-written."""
    if not path.exists() or "row_key" not in pq.read_schema(path).names:
        atomic_write(path, lambda tmp: os.replace(new, tmp))
        return
    if keys is None:
        try:
            atomic_write(path, lambda tmp: append_file(path, new, tmp))
            return
        except ValueError:  # an earlier file of another schema (an older version of this stage): re-write it
            pass
    atomic_write(
        path,
        lambda tmp: _write_chunks(
            tmp,
            metadata=metadata,
            frames=itertools.chain(
                _kept_batches(path, keys, TOKENS_SCHEMA, batch_size),
                (pl.from_arrow(b) for b in pq.ParquetFile(new).iter_batches(batch_size)),
            ),
        ),
    )


def _kept_batches(
    path: Path, keys: pl.DataFrame | None, schema: dict[str, pl.DataType], batch_size: int
) -> Iterator[pl.DataFrame]:
    """The rows of an earlier output whose (id, row_key) is still current, a batch at a time (old token rows are
    ~13 KB each: a whole-table join would hold them all)."""
    if not path.exists() or "row_key" not in pq.read_schema(path).names:
        return
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
        df = pl.from_arrow(batch)
        df = df.with_columns(pl.lit(None, dtype=t).alias(c) for c, t in schema.items() if c not in df.columns)
        kept = df.select(list(schema))
        if keys is not None:  # None: all of them
            kept = kept.join(keys, on=["id", "row_key"], how="semi")
        if kept.height:
            yield kept


def _scan_with_keys(path: Path, schema: dict[str, pl.DataType]) -> pl.LazyFrame:
    """An earlier output with its row keys, or an empty frame (none yet, or written before row keys existed)."""
    if path.exists() and "row_key" in pq.read_schema(path).names:
        return pl.scan_parquet(path)
    return pl.LazyFrame(schema=schema)


def summarize(layout: DatasetLayout) -> TokensSummary:
    """The partition's totals, from the written tables' small columns."""
    t = pl.scan_parquet(layout.tokens)
    agg = (
        t.select(
            pl.len().alias("rows"),
            pl.col("n_tokens").sum().alias("tokens"),
            pl.col("n_loss_tokens").sum().alias("loss"),
            pl.col("reference_match").is_not_null().sum().alias("reference"),
            pl.col("reference_match").sum().alias("match"),
            pl.col("match_explained").sum().alias("explained"),
        )
        .collect()
        .row(0, named=True)
    )
    kinds = t.select("mismatch").drop_nulls().collect()["mismatch"].value_counts().rows()
    sources = t.select("ids_source").collect()["ids_source"].value_counts().rows()
    errors = pl.read_parquet(layout.tokens_errors, columns=["reason"])["reason"].to_list()
    return TokensSummary(
        n_rows=agg["rows"],
        n_errors=len(errors),
        n_reference=int(agg["reference"] or 0),
        n_match=int(agg["match"] or 0),
        n_explained=int(agg["explained"] or 0),
        mismatch_kinds=Counter(dict(kinds)),
        ids_source=Counter(dict(sources)),
        n_tokens=int(agg["tokens"] or 0),
        n_loss_tokens=int(agg["loss"] or 0),
        errors=Counter(r[:80] for r in errors),
    )


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


STATE_KEY = "eagle3.tokens_state"


def _recorded_state(path: Path) -> dict | None:
    """What the last build of tokens.parquet read (tokenizer fingerprint, prompts version, journal parts)."""
    if not path.exists():
        return None
    raw = (pq.read_schema(path).metadata or {}).get(STATE_KEY.encode())
    return json.loads(raw) if raw else None


def _write_chunks(path: Path, frames: Iterator[pl.DataFrame], metadata: dict[str, str] | None = None) -> None:
    """Frames into one Parquet file, a row group each; no frames: an empty file with the full schema (and the
    metadata), written the same way so that rows can later be appended to it."""

    def arrow(df: pl.DataFrame) -> pa.Table:
        table = df.to_arrow()
        return (
            table.replace_schema_metadata({**(table.schema.metadata or {}), **metadata})
            if metadata
            else table
        )

    writer: pq.ParquetWriter | None = None
    try:
        for df in frames:
            table = arrow(df)
            if writer is None:
                writer = _parquet_writer(path, table.schema)
            if df.height:
                writer.write_table(table)
        if writer is None:
            writer = _parquet_writer(path, arrow(pl.DataFrame(schema=TOKENS_SCHEMA)).schema)
    finally:
        if writer is not None:
            writer.close()


def _parquet_writer(path: Path, schema: pa.Schema) -> pq.ParquetWriter:
    # zstd level 1 (~1.5x faster than the default level, same size). Dictionary encoding only for the few-valued
    # string columns: tried on the token ids it costs 3.5x the write time (the writer builds a dictionary of the
    # vocabulary per chunk) and the file came out no smaller after zstd.
    return pq.ParquetWriter(
        path,
        schema,
        compression="zstd",
        compression_level=1,
        use_dictionary=[c for c in DICTIONARY_COLUMNS if c in schema.names],
    )


DICTIONARY_COLUMNS = ("ids_source", "mismatch", "finish_reason", "reason")

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
    stop_ids = {i for i in (chat.eot_id, chat.tok.eos_token_id) if i is not None}
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
    results = chat.tokenize(convs, train_all=train_all)
    features = [answer_features(a.content, a.reasoning) for _, a in convs]
    for pid, res, ref, fin, fr, key, feats in zip(
        rows["id"], results, rows["output_ids"], finished, reasons, rows["row_key"], features, strict=True
    ):
        if isinstance(res, TemplateError):
            errors.append({"id": pid, "reason": str(res), "row_key": key, **feats})
            summary.errors[str(res)[:80]] += 1
            continue
        input_ids, mask, source, cmp = _resolve_row(res, ref, fin, chat, stop_ids, prefer_reference)
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
    cmp = compare(res.answer_ids, reference, chat.encoder.decode, finished)
    if cmp.match or not prefer_reference:
        return res.input_ids, res.loss_mask, "reconstructed" if not cmp.match else "reference", cmp
    head = res.input_ids[: res.answer_start]
    ids = np.concatenate([head, np.asarray(reference, dtype=np.int32)])
    mask = np.concatenate([res.loss_mask[: res.answer_start], np.ones(len(reference), dtype=np.int8)])
    return ids, mask, "reference", cmp
