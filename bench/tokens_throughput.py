"""tokens stage throughput on the same 20k conversations, as ratios against two baselines measured in this run:

- ceiling: the raw `tokenizers` `encode_batch` over the already rendered conversations (no template work at all);
- naive: per-row `apply_chat_template(tokenize=True)`.

Ours is `ChatTokenizer.tokenize` in batches (template plans, text-only encoding of every run, splicing, loss masks),
and the whole `build_tokens` stage (Parquet in and out, reference comparison) for scale.
"""

from __future__ import annotations

import random
import tempfile
import time
from pathlib import Path

import polars as pl

from eagle3_assets.core.chat_tokens import Answer, ChatRecipe, ChatTokenizer, chat_tokenizer
from eagle3_assets.core.ingest import ingest
from eagle3_assets.core.layout import DatasetLayout
from eagle3_assets.core.store import RESPONSE_SCHEMA, JournalTable
from eagle3_assets.core.target import builtin_dir
from eagle3_assets.core.tokens import build_tokens

REPO = Path(__file__).resolve().parent.parent
N = 20_000
BATCH = 2048


def conversations(n: int, seed: int = 0) -> list[tuple[list[dict], Answer]]:
    """n conversations built from the demo prompts (all formats, multi-turn, multilingual) and answers of
    realistic length (1-12 paragraphs of real prompt text)."""
    rng = random.Random(seed)
    prompts: list[list[dict]] = []
    for path, fmt in [
        (f"prompts/B{i}.jsonl", f)
        for i, f in zip(
            range(1, 9),
            [
                "sharegpt",
                "messages",
                "instruction",
                "instruction",
                "messages",
                "sharegpt",
                "instruction",
                "messages",
            ],
            strict=True,
        )
    ]:
        prompts += ingest(REPO / path, fmt).prompts["messages"].to_list()
    paragraphs = [m["content"] for p in prompts for m in p]
    out = []
    for _ in range(n):
        msgs = rng.choice(prompts)
        answer = "\n\n".join(rng.choice(paragraphs) for _ in range(rng.randint(1, 12)))
        out.append((msgs, Answer(answer, None, rng.random() < 0.7)))
    return out


def _rendered(chat: ChatTokenizer, convs) -> list[str]:
    return [
        chat.render([*m, {"role": "assistant", "content": a.content}], add_generation_prompt=False)
        for m, a in convs
    ]


def run(quick: bool = False) -> dict:
    n = 2000 if quick else N
    chat = chat_tokenizer(ChatRecipe(str(builtin_dir("smollm2"))))  # a recipe: the stage can use every core
    tok = chat.tok
    convs = conversations(n)
    texts = _rendered(chat, convs)
    raw = tok.backend_tokenizer

    t0 = time.perf_counter()
    ceiling_tokens = sum(len(e.ids) for e in raw.encode_batch(texts, add_special_tokens=False))
    ceiling_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    ours_tokens = 0
    for i in range(0, n, BATCH):
        ours_tokens += sum(len(r.input_ids) for r in chat.tokenize(convs[i : i + BATCH]))
    ours_s = time.perf_counter() - t0

    sample = convs[: max(1, n // 10)]  # the naive loop is slow: time a tenth and scale
    t0 = time.perf_counter()
    naive_tokens = 0
    for m, a in sample:
        naive_tokens += len(
            tok.apply_chat_template(
                [*m, {"role": "assistant", "content": a.content}], tokenize=True, return_dict=False
            )
        )
    naive_s = time.perf_counter() - t0

    stage_s, workers = _whole_stage_seconds(chat, convs)
    r = {
        "conversations": n,
        "tokens": ours_tokens,
        "ceiling_tok_s": ceiling_tokens / ceiling_s,
        "ours_tok_s": ours_tokens / ours_s,
        "naive_tok_s": naive_tokens / naive_s,
        "stage_tok_s": ours_tokens / stage_s,
        "stage_workers": workers,
    }
    r["ours_vs_ceiling"] = r["ours_tok_s"] / r["ceiling_tok_s"]
    r["ours_vs_naive"] = r["ours_tok_s"] / r["naive_tok_s"]
    r["stage_vs_ceiling"] = r["stage_tok_s"] / r["ceiling_tok_s"]
    print(f"{n:,} conversations, {ours_tokens:,} tokens (SmolLM2 fast tokenizer, 2 cores)")
    print(f"{'':28}{'tokens/s':>12}{'vs ceiling':>12}")
    for name, key in (
        ("ceiling: encode_batch", "ceiling_tok_s"),
        ("ours: ChatTokenizer.tokenize", "ours_tok_s"),
        (f"ours: whole stage, {r['stage_workers']} threads", "stage_tok_s"),
        ("naive: apply_chat_template", "naive_tok_s"),
    ):
        print(f"{name:28}{r[key]:>12,.0f}{r[key] / r['ceiling_tok_s']:>12.2f}")
    print(f"ours / naive: {r['ours_vs_naive']:.1f}x   (goal: ours >= 0.7 of the ceiling)")
    return r


def _whole_stage_seconds(chat: ChatTokenizer, convs) -> tuple[float, int]:
    """build_tokens end to end: read prompts + responses, tokenize (every core), compare, write tokens.parquet."""
    with tempfile.TemporaryDirectory() as tmp:
        layout = DatasetLayout(Path(tmp), "B1").ensure()
        ids = [f"c{i}" for i in range(len(convs))]
        pl.DataFrame({"id": ids, "messages": [m for m, _ in convs]}).write_parquet(layout.prompts)
        cols = {k: [None] * len(convs) for k in RESPONSE_SCHEMA}
        cols.update(
            id=ids,
            content=[a.content for _, a in convs],
            finish_reason=["stop" if a.finished else "length" for _, a in convs],
        )
        JournalTable(layout.responses_dir, RESPONSE_SCHEMA).append(pl.DataFrame(cols, schema=RESPONSE_SCHEMA))
        t0 = time.perf_counter()
        summary = build_tokens(layout, chat, log=lambda m: None)
        return time.perf_counter() - t0, summary.workers
