"""Inputs and probes of the hidden-states tests on the embedded SmolLM2: a tokens.parquet to extract from, the
extraction settings of either engine, an independent forward to compare stored states with, the five checks'
verdicts, and shards rewritten the way a broken extraction would leave them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import polars as pl
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_assets.config import HiddenStatesConfig, VllmExtractionConfig
from eagle3_assets.core.hidden_states import checks as hidden_checks
from eagle3_assets.core.hidden_states.extraction import (
    ExtractionSettings,
    expected_metadata,
    load_target_model,
    skipped_samples,
)
from eagle3_assets.core.hidden_states.shards import finished_shards
from eagle3_assets.core.storage.layout import DatasetLayout
from eagle3_assets.core.target_model.chat import Answer

H, L = 576, 30  # SmolLM2-135M: hidden size, decoder layers
QUESTIONS = [
    "What is the tallest mountain?",
    "Name three prime numbers.",
    "Say hello in French.",
    "Why do cats purr?",
    "What is 12 squared?",
    "Write a haiku about rain.",
    "Define entropy.",
    "Give a synonym for happy.",
]
ANSWERS = [
    "Mount Everest.",
    "2, 3 and 5.",
    "Bonjour!",
    "Mostly contentment, sometimes stress.",
    "144.",
    "Soft rain on the roof\nwhispers to the sleeping town\npuddles hold the sky",
    "Disorder, measured.",
    "Joyful.",
]
ShardChange = Callable[[dict, dict], None]  # (tensors, metadata), altered in place


def write_tokens(chat, root, key="B1", n=8, repeat=1) -> DatasetLayout:
    """tokens.parquet of `n` canned question/answer pairs (`repeat` times, each round's questions varied)."""
    layout = DatasetLayout(root, key).ensure()
    convs, ids = [], []
    for r in range(repeat):
        for i in range(n):
            q = QUESTIONS[i % len(QUESTIONS)] + (f" (variant {r})" if r else "")
            convs.append(([{"role": "user", "content": q}], Answer(ANSWERS[i % len(ANSWERS)])))
            ids.append(f"s{r:02d}-{i:02d}")
    res = chat.tokenize(convs)
    pl.DataFrame(
        {
            "id": ids,
            "input_ids": pl.Series([x.input_ids.tolist() for x in res], dtype=pl.List(pl.Int32)),
            "loss_mask": pl.Series([x.loss_mask.tolist() for x in res], dtype=pl.List(pl.Int8)),
        }
    ).write_parquet(layout.tokens)
    return layout


def extraction_settings(**kw) -> ExtractionSettings:
    """In-process extraction with `hidden_states` set to `kw`."""
    return ExtractionSettings(hidden=HiddenStatesConfig(**kw))


def served_settings(base_url: str, storage: Path, **hidden) -> ExtractionSettings:
    """Extraction through the vLLM server at `base_url` whose connector writes under `storage`."""
    vllm = VllmExtractionConfig(
        base_urls=[base_url],
        storage_path=str(storage),
        max_retries=hidden.pop("max_retries", 4),
        file_timeout_s=hidden.pop("file_timeout_s", 60.0),
    )
    return ExtractionSettings(hidden=HiddenStatesConfig(engine="vllm", vllm=vllm, **hidden))


def reference_states(model, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An independent plain forward of one sample, with hooks of its own: (aux [T, 3H], last pre-norm,
    post-norm)."""
    grabbed = {}
    handles = [
        model.model.layers[i].register_forward_hook(
            lambda _m, _i, out, i=i: grabbed.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i in (1, 14, 26, 29)
    ]
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids]), output_hidden_states=True)
    finally:
        for h in handles:
            h.remove()
    aux = torch.cat([grabbed[1][0], grabbed[14][0], grabbed[26][0]], dim=-1)
    return aux, grabbed[29][0], out.hidden_states[-1][0]


def verdicts(layout, s) -> dict[str, bool]:
    """Whether each of the five hidden_states checks passes on `layout`'s states, extracted with `s`."""
    folder = layout.hidden_states_dir
    tokens = pl.read_parquet(layout.tokens)
    index = pl.read_parquet(folder / "index.parquet")
    return {
        "coverage": hidden_checks.coverage(tokens, index, skipped_samples(layout)).passed,
        "ids_match": hidden_checks.ids_match(folder, tokens).passed,
        "finite": hidden_checks.finite(folder).passed,
        "consistent": hidden_checks.consistent(folder, expected_metadata(s)).passed,
        "spot_check": hidden_checks.spot_check(
            folder, load_target_model(s), hidden_checks.spot_sample_ids(index, 6)
        ).passed,
    }


def rewrite_shard(folder, change: ShardChange, name: str | None = None) -> None:
    """Load a shard (the first by default), let `change(tensors, meta)` alter it, save it back under its
    name."""
    name = name or sorted(finished_shards(folder))[0]
    path = folder / name
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
        meta = dict(f.metadata())
    change(tensors, meta)
    save_file(tensors, str(path), metadata=meta)


def rewrite_every_shard(folder, change: ShardChange) -> None:
    for name in finished_shards(folder):
        rewrite_shard(folder, change, name)
