"""tokens: every answered conversation as `input_ids` + `loss_mask`, checked against the ids the model
produced.

Where a backend returned its output ids (embedded model, SGLang, imported data) those are ground truth: the
row keeps them (unless configured otherwise) and `reference_match` says whether the reconstruction from text
gave the same ids. Text-only answers (OpenRouter) get the reconstruction, `reference_match` null.
"""

from __future__ import annotations

import shutil
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq

from ...config import TokensConfig
from ..prompts.fingerprints import digest
from ..storage.files import available_cores, write_parquet
from ..storage.layout import DatasetLayout
from ..storage.quarantine import parquet_problem, sweep_parquet
from ..storage.tables import RESPONSE_SCHEMA, JournalTable
from ..storage.versions import file_version
from ..target_model.chat import ChatTokenizer
from .chunks import TOKENS_ERRORS_SCHEMA, TOKENS_SCHEMA, TokensSummary, tokenize_in_parallel
from .parquet_io import (
    STATE_KEY,
    BuildState,
    batch_frame,
    kept_batches,
    place_tokens,
    recorded_state,
    scan_with_keys,
    write_chunks,
)
from .turns import with_turn_prompts


def row_keys(rows: pl.DataFrame, fingerprint: str) -> pl.DataFrame:
    """A content key per row: the prompt, the answer, its reference ids, and the tokenizer and options that
    turn them into ids. A row whose key is unchanged is never tokenized again. (polars' hash may change
    between polars versions; the version is part of the fingerprint, so an upgrade re-tokenizes once rather
    than trusting it.)"""
    parts = [
        pl.col("messages").list.eval(pl.element().struct.json_encode()).list.join("\x1e"),
        pl.col("content").fill_null(""),
        pl.col("reasoning").fill_null("\x00"),
        pl.col("finish_reason").fill_null(""),
        pl.col("output_ids").cast(pl.List(pl.String)).list.join(",").fill_null("-"),
        # The conversation-row mark (`all_turns`) is part of the key: a written row without the mark is
        # tokenized once more, so that every conversation row carries it.
        pl.when(pl.col("all_turns")).then(pl.lit("all turns, marked")).otherwise(pl.lit("false")),
        pl.col("history_refs").list.eval(pl.element().struct.json_encode()).list.join("|").fill_null("-"),
        pl.lit(f"{fingerprint}|polars {pl.__version__}"),
    ]
    key = pl.concat_str(parts, separator="\x1f").hash(seed=7)
    if "tools" not in rows.columns and rows.get_column("tool_calls").null_count() == rows.height:
        return rows.with_columns(key.alias("row_key"))
    # Rows with tools or calls: those count too (a row without keeps the key it always had).
    tools = pl.col("tools") if "tools" in rows.columns else pl.lit(None, pl.String)
    agentic = pl.col("tool_calls").is_not_null() | tools.is_not_null()
    keyed = pl.concat_str(
        [key.cast(pl.String), pl.col("tool_calls").fill_null("-"), tools.fill_null("-")], separator="\x1f"
    ).hash(seed=7)
    return rows.with_columns(pl.when(agentic).then(keyed).otherwise(key).alias("row_key"))


PROGRESS_EVERY_S = 10.0
# The version of the reference comparison's verdicts: a new one re-keys every row once (2: the model's own
# splits).
COMPARISON = 2
RESPONSE_COLUMNS = ["id", "content", "reasoning", "finish_reason", "output_ids", "tool_calls"]
STAGE = "tokens"  # its quarantine folder


def response_batches(
    layout: DatasetLayout, batch_size: int, parts: list[str] | None = None, seen: set[str] | None = None
) -> Iterator[pl.DataFrame]:
    """The stored answers, one row per id (the first stored wins, as everywhere), a batch at a time: memory
    holds one batch of text, never the partition. `parts`: only these journal files; `seen`: ids to skip."""
    table = JournalTable(layout.responses_dir, RESPONSE_SCHEMA)
    seen = set() if seen is None else seen
    for path in table.files():
        if parts is not None and path.name not in parts:
            continue
        if parquet_problem(path, RESPONSE_SCHEMA, ["id"]) is not None:
            continue  # damaged: the responses stage sets it aside and asks its prompts again
        for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_size):
            df = batch_frame(batch)
            for name in RESPONSE_COLUMNS:  # a part written with fewer columns reads the missing ones as null
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
    settings: TokensConfig | None = None,
    log: Callable[[str], None] = print,
    workers: int | None = None,
    exclude: Collection[str] = (),
) -> TokensSummary:
    """Tokenize the answered conversations that are new or changed since tokens.parquet was written, keep the
    rest as they are, and write tokens.parquet and tokens_errors.parquet again, streaming: a top-up of 1,000
    answers to a partition of 200,000 tokenizes 1,000 and copies the others, and memory holds a few batches,
    not the partition.

    Chunks are tokenized on a thread per core (`tokenize_in_parallel`) while this thread reads, hashes and
    writes. `exclude`: stored answers that no longer stand (`generation.binding.standing_answers`): never
    trained, and no turn's history is rebuilt from them.
    """
    # Damaged outputs of an earlier build are set aside and rebuilt (a missing tokens.parquet is a full
    # build).
    set_aside = sweep_parquet(
        layout.dir, [layout.tokens], STAGE, TOKENS_SCHEMA, ["id", "input_ids", "loss_mask"]
    )
    set_aside += sweep_parquet(
        layout.dir, [layout.tokens_errors], STAGE, TOKENS_ERRORS_SCHEMA, ["id", "reason"]
    )
    for q in set_aside:
        log(f"tokens: set aside {q.describe()}; rebuilding it")
    build = TokensBuild(
        layout, chat, settings or TokensConfig(), log, workers or available_cores(), frozenset(exclude)
    )
    build.write()
    summary = summarize(layout)
    summary.set_aside = set_aside
    summary.n_tokenized = build.progress.todo
    summary.workers = build.workers
    return summary


@dataclass
class BuildProgress:
    """A build's counts, kept as the chunks are read (`todo`) and as they come back tokenized (`done`)."""

    todo: int = 0  # rows sent to be tokenized (new or changed)
    done: int = 0  # rows tokenized or refused so far
    next_log: float = 0.0  # time.monotonic() of the next progress line


class TokensBuild:
    """One build of a partition's tokens: what the last build left and what is there now decide the rows to
    tokenize; the new rows are tokenized in chunks and placed beside the rows that still stand."""

    def __init__(
        self,
        layout: DatasetLayout,
        chat: ChatTokenizer,
        settings: TokensConfig,
        log: Callable[[str], None],
        workers: int,
        exclude: frozenset[str] = frozenset(),
    ):
        self.layout, self.chat, self.settings, self.log, self.workers = layout, chat, settings, log, workers
        self.exclude = exclude
        train_all, prefer_reference = settings.train_all_assistant_turns, settings.prefer_reference_ids
        options = f"train_all={train_all}|prefer_reference={prefer_reference}|compare={COMPARISON}"
        self.fingerprint = f"{chat.fingerprint()}|{options}"
        tools = ["tools"] if "tools" in pq.read_schema(layout.prompts).names else []  # a dataset with tools
        self.prompts = with_turn_prompts(
            pl.read_parquet(layout.prompts, columns=["id", "messages", *tools]), layout, chat, exclude
        )
        old_errors = scan_with_keys(layout.tokens_errors, TOKENS_ERRORS_SCHEMA)
        self.old_keys = scan_with_keys(layout.tokens, TOKENS_SCHEMA).select("id", "row_key").collect()
        # (id, row_key) of every row written: token rows and error rows
        self.done = pl.concat([self.old_keys, old_errors.select("id", "row_key").collect()])
        self.current: list[pl.DataFrame] = []  # (id, row_key) of every row now: small
        self.errors: list[dict] = []  # the error rows of the rows tokenized
        self.progress = BuildProgress(next_log=time.monotonic() + PROGRESS_EVERY_S)
        self.state = BuildState(
            self.fingerprint,
            file_version(layout.prompts),
            [p.name for p in JournalTable(layout.responses_dir, RESPONSE_SCHEMA).files()],
            digest(sorted(exclude)) if exclude else "",
        )
        self.last = recorded_state(layout.tokens)
        self.new_parts = self._parts_added_since_last()

    def _parts_added_since_last(self) -> list[str] | None:
        """Journal parts are immutable: when the prompts and the tokenizer are as they were and every part the
        last build read is still there, only the parts added since can hold new rows (a top-up reads 1,000
        answers, not the partition's). None: anything else (a compaction, new prompts, another template)
        re-keys every row.

        A conversation row is named by its last stored turn: a top-up that adds a turn renames it, so the old
        row must go (a full pass drops rows whose id is no longer current; an append would keep both)."""
        last, now = self.last, self.state
        merged_turns = bool(self.prompts["all_turns"].any())
        if (
            last is None
            or not self.layout.tokens_errors.exists()
            or last.fingerprint != now.fingerprint
            or last.prompts != now.prompts
            or last.excluded != now.excluded
            or not set(last.parts) <= set(now.parts)
            or merged_turns
        ):
            return None
        return [p for p in now.parts if p not in set(last.parts)]

    def write(self) -> None:
        scratch = self.layout.scratch(f"tokens-{time.time_ns()}")
        scratch.mkdir(parents=True, exist_ok=True)
        try:
            self._write_outputs(scratch / "new.parquet")
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _write_outputs(self, new: Path) -> None:
        metadata = {STATE_KEY: self.state.to_json()}
        write_chunks(new, self._tokenized(), metadata=metadata)
        keys = (
            None  # every earlier row stands
            if self.new_parts is not None
            else pl.concat(self.current)
            if self.current
            else pl.DataFrame(schema={"id": pl.String, "row_key": pl.UInt64})
        )
        stale = keys is not None and self.old_keys.join(keys, on=["id", "row_key"], how="anti").height > 0
        unchanged = self.progress.todo == 0 and (keys is None or self.done.height == keys.height)
        if unchanged and self.layout.tokens.exists() and self.last == self.state:
            return  # every current row is already written and nothing written is stale: the outputs stand
        # No earlier token row is stale (a top-up, or nothing new after a compaction): the new rows (maybe
        # none; the file then gets the new state, so the next top-up reads only new parts again) are appended.
        batch_size = self.settings.batch_size
        place_tokens(self.layout.tokens, new, keys if stale else None, batch_size, metadata)
        new_errors = pl.DataFrame(self.errors, schema=TOKENS_ERRORS_SCHEMA)
        kept_errors = list(kept_batches(self.layout.tokens_errors, keys, TOKENS_ERRORS_SCHEMA, batch_size))
        write_parquet(
            pl.concat([*kept_errors, new_errors], how="vertical_relaxed"), self.layout.tokens_errors
        )

    def _todo_chunks(self) -> Iterator[pl.DataFrame]:
        """Prompt + response rows to tokenize, with their keys: in a top-up the rows of the new parts, else
        every row whose key is not written yet (the keys of all current rows are kept in `current`)."""
        batch_size = self.settings.batch_size
        if self.new_parts is not None:
            seen = set(self.done["id"].to_list()) | self.exclude
            for batch in response_batches(self.layout, batch_size, self.new_parts, seen):
                rows = row_keys(self.prompts.join(batch, on="id", how="inner"), self.fingerprint)
                self.progress.todo += rows.height
                if rows.height:
                    yield rows
            return
        for batch in response_batches(self.layout, batch_size, seen=set(self.exclude)):
            rows = row_keys(self.prompts.join(batch, on="id", how="inner"), self.fingerprint)
            self.current.append(rows.select("id", "row_key"))
            todo = rows.join(self.done, on=["id", "row_key"], how="anti")
            self.progress.todo += todo.height
            if todo.height:
                yield todo

    def _tokenized(self) -> Iterator[pl.DataFrame]:
        """The token rows of the rows to tokenize, in order; their error rows are kept in `errors`."""
        train_all, prefer = self.settings.train_all_assistant_turns, self.settings.prefer_reference_ids
        for chunk in tokenize_in_parallel(self._todo_chunks(), self.chat, train_all, prefer, self.workers):
            self.errors.extend(chunk.errors)
            self.progress.done += chunk.frame.height + len(chunk.errors)
            if time.monotonic() >= self.progress.next_log:
                # Every few seconds, not every chunk: in Dagster each line is an event written to the
                # instance's database (a line per 512 rows cost a 20M-token step ~10% of its time).
                self.progress.next_log = time.monotonic() + PROGRESS_EVERY_S
                self.log(f"tokens: {self.progress.done:,} new or changed conversations tokenized")
            yield chunk.frame


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
