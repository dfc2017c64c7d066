"""tokens: every answered conversation as `input_ids` + `loss_mask`, checked against the ids the model produced.

Where a backend returned its output ids (embedded model, SGLang, imported data) those are ground truth: the row
keeps them (unless configured otherwise) and `reference_match` says whether the reconstruction from text gave the
same ids. Text-only answers (OpenRouter) get the reconstruction, `reference_match` null.
"""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator

import polars as pl
import pyarrow.parquet as pq

from ...config import TokensConfig
from ..storage.files import available_cores, write_parquet
from ..storage.layout import DatasetLayout
from ..storage.quarantine import parquet_problem, sweep_parquet
from ..storage.tables import RESPONSE_SCHEMA, JournalTable
from ..storage.versions import file_version
from ..target.chat import ChatTokenizer
from .chunks import TOKENS_ERRORS_SCHEMA, TOKENS_SCHEMA, TokensSummary, tokenize_in_parallel
from .parquet_io import (
    STATE_KEY,
    kept_batches,
    place_tokens,
    recorded_state,
    scan_with_keys,
    write_chunks,
)
from .turns import with_turn_prompts


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
        # A conversation row's key changed when tokens.parquet began to mark such rows (`all_turns`): rows written
        # before are tokenized once more, so that every conversation row carries its mark.
        pl.when(pl.col("all_turns")).then(pl.lit("all turns, marked")).otherwise(pl.lit("false")),
        pl.col("history_refs").list.eval(pl.element().struct.json_encode()).list.join("|").fill_null("-"),
        pl.lit(f"{fingerprint}|polars {pl.__version__}"),
    ]
    return rows.with_columns(pl.concat_str(parts, separator="\x1f").hash(seed=7).alias("row_key"))


PROGRESS_EVERY_S = 10.0
# The version of the reference comparison's verdicts: a new one re-keys every row once (2: the model's own splits).
COMPARISON = 2
RESPONSE_COLUMNS = ["id", "content", "reasoning", "finish_reason", "output_ids"]
STAGE = "tokens"  # its quarantine folder


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
        if parquet_problem(path, RESPONSE_SCHEMA, ["id"]) is not None:
            continue  # damaged: the responses stage sets it aside and asks its prompts again
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
    settings: TokensConfig | None = None,
    log: Callable[[str], None] = print,
    workers: int | None = None,
) -> TokensSummary:
    """Tokenize the answered conversations that are new or changed since tokens.parquet was written, keep the rest
    as they are, and write tokens.parquet and tokens_errors.parquet again, streaming: a top-up of 1,000 answers to a
    partition of 200,000 tokenizes 1,000 and copies the others, and memory holds a few batches, not the partition.

    Chunks are tokenized on a thread per core (`tokenize_in_parallel`) while this thread reads, hashes and writes.
    """
    settings = settings or TokensConfig()
    train_all, prefer_reference = settings.train_all_assistant_turns, settings.prefer_reference_ids
    batch_size = settings.batch_size
    fingerprint = (
        f"{chat.fingerprint()}|train_all={train_all}|prefer_reference={prefer_reference}|compare={COMPARISON}"
    )
    # Damaged outputs of an earlier build are set aside and rebuilt (a missing tokens.parquet is a full build).
    set_aside = sweep_parquet(
        layout.dir, [layout.tokens], STAGE, TOKENS_SCHEMA, ["id", "input_ids", "loss_mask"]
    )
    set_aside += sweep_parquet(
        layout.dir, [layout.tokens_errors], STAGE, TOKENS_ERRORS_SCHEMA, ["id", "reason"]
    )
    for q in set_aside:
        log(f"tokens: set aside {q.describe()}; rebuilding it")
    prompts = with_turn_prompts(pl.read_parquet(layout.prompts, columns=["id", "messages"]), layout, chat)
    # A conversation row is named by its last stored turn: a top-up that adds a turn renames it, so the old row
    # must go (a full pass drops rows whose id is no longer current; an append would keep both).
    merged_turns = bool(prompts["all_turns"].any())
    old_tokens = scan_with_keys(layout.tokens, TOKENS_SCHEMA)
    old_errors = scan_with_keys(layout.tokens_errors, TOKENS_ERRORS_SCHEMA)
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
    last = recorded_state(layout.tokens)
    appended = (
        last is not None
        and layout.tokens_errors.exists()
        and last["fingerprint"] == fingerprint
        and last["prompts"] == state["prompts"]
        and set(last["parts"]) <= set(state["parts"])
        and not merged_turns
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

    scratch = layout.scratch(f"tokens-{time.time_ns()}")
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
        write_chunks(new, results(), metadata={STATE_KEY: json.dumps(state)})
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
            summary.set_aside = set_aside
            return summary
        # No earlier token row is stale (a top-up, or nothing new after a compaction): the new rows (maybe none;
        # the file then gets the new state, so the next top-up reads only new parts again) are appended.
        place_tokens(layout.tokens, new, keys if stale else None, batch_size, {STATE_KEY: json.dumps(state)})
        new_errors = pl.DataFrame(errors, schema=TOKENS_ERRORS_SCHEMA)
        kept_errors = list(kept_batches(layout.tokens_errors, keys, TOKENS_ERRORS_SCHEMA, batch_size))
        write_parquet(pl.concat([*kept_errors, new_errors], how="vertical_relaxed"), layout.tokens_errors)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = summarize(layout)
    summary.set_aside = set_aside
    summary.n_tokenized = counter["todo"]
    summary.workers = workers or available_cores()
    return summary


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
