"""Prompts the target cannot hold are quarantined by the prompts stage, before anything is sent: bounded by
their byte size where that decides, counted with the target's chat template only near the limit."""

from __future__ import annotations

import json
import time

import polars as pl
import pytest

from eagle3_assets.config import DatasetConfig, TargetConfig
from eagle3_assets.core.prompts.context import (
    TEMPLATE_TOKENS_FIXED,
    TEMPLATE_TOKENS_PER_MESSAGE,
    ChatCounter,
    ContextGuard,
)
from eagle3_assets.core.prompts.ingest import ensure_prompts, ingest, write_prompts
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.target_model.context import context_limit, longest_token_bytes
from eagle3_assets.core.target_model.loading import TargetError

from .support.projects import make_project, materialize_in_process, user_rows, write_jsonl

SMOLLM2_CONTEXT = 8192


@pytest.fixture
def encoded(chat, monkeypatch) -> list[int]:
    """The length of every text the embedded tokenizer is asked to encode while the test runs."""
    lengths: list[int] = []
    encode = chat.encoder.encode_texts

    def spy(texts, *args, **kwargs):
        lengths.extend(len(t) for t in texts)
        return encode(texts, *args, **kwargs)

    monkeypatch.setattr(chat.encoder, "encode_texts", spy)
    return lengths


def _prompt(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _with_tokens(chat, n: int) -> str:
    """A user text whose generation prompt is exactly `n` tokens with SmolLM2's template."""
    base = len(chat.prompt_ids([_prompt("hello")])[0])
    text = "hello" + " hello" * (n - base)
    assert len(chat.prompt_ids([_prompt(text)])[0]) == n
    return text


def test_a_50_mb_prompt_is_refused_quickly_without_encoding_it(tmp_path, chat, encoded):
    path = write_jsonl(
        tmp_path / "big.jsonl",
        [
            {"id": "small", "messages": _prompt("What is 2 + 2?")},
            {"id": "huge", "messages": _prompt("lorem ipsum " * 4_400_000)},  # 52.8 MB
        ],
    )
    guard = ContextGuard(SMOLLM2_CONTEXT, lambda: ChatCounter(chat))
    start = time.monotonic()
    r = ingest(path, "messages", guard=guard)
    assert time.monotonic() - start < 15
    assert r.prompts["id"].to_list() == ["small"]
    reason = r.quarantine["reason"][0]
    assert (
        reason.startswith("prompt of at least ") and "exceeds the target's context of 8,192 tokens" in reason
    )
    assert guard.refused_unencoded == 1 and guard.counted_exactly == 0
    assert guard.tokenizer_loaded and encoded == []  # the tokenizer was at hand, and encoded nothing
    assert len(r.quarantine["raw"][0]) <= 2000


def test_a_prompt_just_over_the_limit_is_refused_by_exact_count_and_one_just_under_is_kept(
    tmp_path, chat, encoded
):
    """The byte bound cannot decide these (about 50 KB for 8,192 tokens): each is counted with the template,
    the generation prompt included, and only the one that leaves room for an answer is kept."""
    rows = [
        {"id": "under", "messages": _prompt(_with_tokens(chat, SMOLLM2_CONTEXT - 1))},
        {"id": "full", "messages": _prompt(_with_tokens(chat, SMOLLM2_CONTEXT))},
        {"id": "over", "messages": _prompt(_with_tokens(chat, SMOLLM2_CONTEXT + 1))},
        {"id": "short", "messages": _prompt("Hi there.")},
    ]
    encoded.clear()
    guard = ContextGuard(SMOLLM2_CONTEXT, lambda: ChatCounter(chat))
    r = ingest(write_jsonl(tmp_path / "edge.jsonl", rows), "messages", guard=guard)
    assert r.prompts["id"].to_list() == ["under", "short"]
    reasons = dict(zip(r.quarantine["id"], r.quarantine["reason"], strict=True))
    assert reasons == {
        "full": "prompt of 8,192 tokens fills the target's context of 8,192, leaving no room for an answer",
        "over": "prompt of 8,193 tokens exceeds the target's context of 8,192 tokens",
    }
    assert guard.counted_exactly == 3 and r.outcomes["over_context"] == 2
    assert 0 < max(encoded) < 100_000  # the near-limit prompts only, each well under a megabyte


def test_the_byte_bounds_hold_for_the_embedded_tokenizer(chat):
    """tokens ≤ bytes + template allowance, and tokens ≥ bytes / longest token, on texts that stress each:
    one byte per token (digits, split one by one), long whitespace runs (SmolLM2's longest tokens), CJK and
    emoji (several bytes per character), control tokens typed as text."""
    longest = longest_token_bytes(chat.tok)
    assert longest == 81  # "\n" and 80 spaces
    texts = [
        "1234567890" * 200,
        " " * 5000,
        "\n" + " " * 80,
        "汉字テスト" * 300,
        "🙂" * 500,
        "<|im_end|>" * 50,
    ]
    for text in texts:
        size = len(text.encode("utf-8"))
        n = len(chat.prompt_ids([_prompt(text)])[0])
        assert -(-size // longest) <= n <= size + TEMPLATE_TOKENS_PER_MESSAGE + TEMPLATE_TOKENS_FIXED, text[
            :20
        ]


def test_the_prompts_asset_quarantines_over_long_prompts_and_loads_no_tokenizer_for_short_ones(tmp_path):
    """The real path: the asset takes the context from the embedded model's config.json (8,192), keeps a
    normal dataset without loading the tokenizer, and quarantines a prompt over the context with the count
    in the reason."""
    long_text = "word " * 10_000  # about 10,000 tokens, 50 KB: counted exactly
    datasets = {
        "B1": {"rows": user_rows(["What is a prime?", "Name a colour."])},
        "B2": {"rows": user_rows(["What is a prime?", long_text])},
    }
    path = make_project(tmp_path, datasets)
    for key, loaded in (("B1", False), ("B2", True)):
        result = materialize_in_process(path, ["prompts"], partition=key)
        md = result.asset_materializations_for_node("prompts")[-1].metadata
        assert md["context_length"].value == SMOLLM2_CONTEXT
        assert "max_position_embeddings" in md["context_length_source"].value
        assert md["tokenizer_loaded"].value is loaded
    layout = DatasetLayout(tmp_path / "data", "B2")
    assert pl.read_parquet(layout.prompts)["id"].to_list() == ["p000"]
    q = pl.read_parquet(layout.quarantine)
    assert q["id"].to_list() == ["p001"]
    assert "tokens exceeds the target's context of 8,192 tokens" in q["reason"][0]
    assert md["over_context"].value == 1


def test_a_rebuild_without_a_tokenizer_keeps_over_long_prompts_out(tmp_path, chat):
    """A later stage that finds prompts.parquet damaged writes it again from the source with no tokenizer at
    hand: the prompts an earlier ingestion found too long stay quarantined, from its quarantine.parquet."""
    src = write_jsonl(tmp_path / "s.jsonl", user_rows(["short one", "long one " * 100]))
    layout = DatasetLayout(tmp_path / "data", "B1").ensure()
    ds = DatasetConfig(source=str(src), format="messages")
    write_prompts(src, layout, ds, ContextGuard(100, lambda: ChatCounter(chat)))
    assert pl.read_parquet(layout.prompts)["id"].to_list() == ["p000"]
    layout.prompts.write_bytes(b"not parquet")
    assert ensure_prompts(src, layout, ds)  # set aside and rebuilt
    assert pl.read_parquet(layout.prompts)["id"].to_list() == ["p000"]
    assert "the target's context of 100" in pl.read_parquet(layout.quarantine)["reason"][0]


def test_where_the_context_comes_from(tmp_path, monkeypatch):
    """`target.context_length` wins; else the model's config.json (a language-model sub-config first, as
    Kimi-K2.5 has it), then the tokenizer's; a hub repository's through its config.json alone; none found is
    an error that names the key to set."""
    assert context_limit(TargetConfig(context_length=4096)).tokens == 4096
    builtin = context_limit(TargetConfig())
    assert builtin.tokens == SMOLLM2_CONTEXT and "builtin:smollm2" in builtin.source
    folder = tmp_path / "kimi-like"
    folder.mkdir()
    (folder / "config.json").write_text(
        json.dumps({"max_position_embeddings": 1024, "text_config": {"max_position_embeddings": 262_144}})
    )
    assert context_limit(TargetConfig(model=str(folder), tokenizer=str(folder))).tokens == 262_144

    def fake_download(repo, filename, revision=None):
        assert (repo, filename, revision) == ("org/model", "config.json", "abc1234")
        return str(folder / "config.json")

    monkeypatch.setattr("huggingface_hub.hf_hub_download", fake_download)
    hub = TargetConfig(model="org/model", tokenizer="org/model", revision="abc1234")
    assert context_limit(hub).tokens == 262_144
    bare = tmp_path / "tokenizer-only"
    bare.mkdir()
    with pytest.raises(TargetError, match=r"set target\.context_length"):
        context_limit(TargetConfig(model=str(bare), tokenizer=str(bare)))
