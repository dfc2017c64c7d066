"""A top-up costs what it adds: only new or changed conversations are tokenized again; the journal folds a
run's own parts, not the whole table."""

from __future__ import annotations

import json

import polars as pl
import pyarrow.parquet as pq

from eagle3_assets.config import DatasetConfig, TokensConfig
from eagle3_assets.core.generation.binding import AnswerRules
from eagle3_assets.core.generation.importer import import_responses
from eagle3_assets.core.generation.journal import ResponseJournal
from eagle3_assets.core.prompts.ingest import write_prompts
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.storage.parquet_append import read_footer
from eagle3_assets.core.tokens.build import STATE_KEY, build_tokens

from .support.engine_runs import IMPORTED_AS_TARGET, SMOLLM2
from .support.projects import user_rows, write_jsonl


def partition(tmp_path, texts: list[str]) -> DatasetLayout:
    layout = DatasetLayout(tmp_path / "data", "B1").ensure()
    source = write_jsonl(tmp_path / "B1.jsonl", user_rows(texts))
    write_prompts(source, layout, DatasetConfig(source=str(source), format="messages"))
    return layout


def answer(layout, tmp_path, chat, ids: list[str], name: str, text: str = "An answer.") -> None:
    src = tmp_path / f"{name}.jsonl"
    src.write_text("\n".join(json.dumps({"id": i, "response": f"{text} ({i})"}) for i in ids))
    import_responses(layout, src, chat, IMPORTED_AS_TARGET, model=SMOLLM2)


def test_a_top_up_tokenizes_only_what_is_new_or_changed(tmp_path, chat):
    texts = [f"question number {i}" for i in range(30)]
    layout = partition(tmp_path, texts)
    ids = pl.read_parquet(layout.prompts)["id"].to_list()
    answer(layout, tmp_path, chat, ids[:20], "first")
    first = build_tokens(layout, chat, log=lambda m: None)
    assert first.n_tokenized == 20 and first.n_rows == 20
    before = pl.read_parquet(layout.tokens).sort("id")

    # Nothing changed: nothing is tokenized, the table is the same.
    again = build_tokens(layout, chat, log=lambda m: None)
    assert again.n_tokenized == 0 and again.n_rows == 20
    assert pl.read_parquet(layout.tokens).sort("id").equals(before)

    # A top-up of 5 answers: 5 tokenized, 20 kept byte for byte (their pages copied, not decoded and
    # re-encoded).
    _, old_end = read_footer(layout.tokens)
    old_bytes = layout.tokens.read_bytes()[:old_end]
    answer(layout, tmp_path, chat, ids[20:25], "second")
    topped = build_tokens(layout, chat, log=lambda m: None)
    assert topped.n_tokenized == 5 and topped.n_rows == 25
    after = pl.read_parquet(layout.tokens)
    assert after.filter(pl.col("id").is_in(ids[:20])).sort("id").equals(before)
    assert layout.tokens.read_bytes()[:old_end] == old_bytes

    # A prompt whose text changed at the source (same id): its answer answered another question, so it no
    # longer stands (the responses stage sets it aside and asks again) and its row goes; nothing is redone.
    changed = [*texts[:-1]]
    changed[3] = "question number 3, reworded"
    source = write_jsonl(tmp_path / "B1.jsonl", user_rows(changed))
    write_prompts(source, layout, DatasetConfig(source=str(source), format="messages"))
    stale = ResponseJournal(layout).standing(AnswerRules("last", {}, {})).aside
    assert set(stale) == {ids[3]}
    redo = build_tokens(layout, chat, log=lambda m: None, exclude=stale)
    assert redo.n_tokenized == 0 and redo.n_rows == 24 and ids[3] not in token_ids(layout)

    # A compaction replaces the journal's files: every row is keyed again, none is redone, and the file
    # records the new parts (so the next top-up reads only what is added after the compaction).
    redone = pl.read_parquet(layout.tokens).sort("id")
    ResponseJournal(layout).compact()
    assert build_tokens(layout, chat, log=lambda m: None, exclude=stale).n_tokenized == 0
    assert pl.read_parquet(layout.tokens).sort("id").equals(redone)
    parts = [p.name for p in ResponseJournal(layout).responses.files()]
    assert json.loads(pq.read_schema(layout.tokens).metadata[STATE_KEY.encode()])["parts"] == parts
    answer(layout, tmp_path, chat, ids[25:27], "third")
    assert build_tokens(layout, chat, log=lambda m: None, exclude=stale).n_tokenized == 2

    # Another template option changes every conversation's ids: everything is redone.
    options = TokensConfig(train_all_assistant_turns=True)
    assert build_tokens(layout, chat, options, log=lambda m: None, exclude=stale).n_tokenized == 26


def token_ids(layout) -> set[str]:
    return set(pl.read_parquet(layout.tokens, columns=["id"])["id"].to_list())


def test_a_run_folds_its_own_parts_and_leaves_the_table_alone(tmp_path, chat):
    layout = partition(tmp_path, [f"q {i}" for i in range(12)])
    ids = pl.read_parquet(layout.prompts)["id"].to_list()
    answer(layout, tmp_path, chat, ids[:6], "first")
    journal = ResponseJournal(layout)
    files_before = {p.name for p in journal.responses.files()}
    answer(layout, tmp_path, chat, ids[6:], "second")
    files_after = {p.name for p in journal.responses.files()}
    # The earlier file is untouched; the import added one file of its own.
    assert files_before < files_after and len(files_after - files_before) == 1
    rows, keys = journal.responses.row_count()
    assert rows == keys == 12


def test_eagle3_compact_folds_the_journal_into_one_file(tmp_path, chat):
    """Compaction is a separate, occasional step: `eagle3 compact` leaves one file per table, every answer
    kept."""
    from eagle3_assets.cli import main

    layout = partition(tmp_path, [f"q {i}" for i in range(9)])
    ids = pl.read_parquet(layout.prompts)["id"].to_list()
    for n, part in enumerate((ids[:3], ids[3:6], ids[6:])):
        answer(layout, tmp_path, chat, part, f"run{n}")
    journal = ResponseJournal(layout)
    assert len(journal.responses.files()) == 3
    cfg = tmp_path / "eagle3.yaml"
    cfg.write_text(
        json.dumps(
            {"storage": {"root": "data"}, "datasets": {"B1": {"source": "B1.jsonl", "format": "messages"}}}
        )
    )
    assert main(["--config", str(cfg), "compact", "--dataset", "B1"]) == 0
    assert len(journal.responses.files()) == 1
    assert sorted(journal.responses.scan(["id"]).collect()["id"].to_list()) == sorted(ids)
