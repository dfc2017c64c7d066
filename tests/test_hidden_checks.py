"""Each hidden_states check passes on good states and fails on the data that should fail it: a missing sample,
ids that are not tokens.parquet's, a NaN, a shard from another extraction, states shifted by one position or
belonging to other samples."""

from __future__ import annotations

import itertools
import json

import polars as pl
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from eagle3_assets.core.hidden_states.extraction import (
    extract_dataset,
)
from eagle3_assets.core.hidden_states.shards import finished_shards

from .support.hidden_states import extraction_settings, rewrite_shard, verdicts, write_tokens


@pytest.fixture
def extracted(chat, tmp_path):
    layout = write_tokens(chat, tmp_path, n=6)
    s = extraction_settings()
    extract_dataset(layout, s, log=lambda m: None)
    return layout, s


def test_good_states_pass_every_check(extracted):
    assert verdicts(*extracted) == dict.fromkeys(
        ["coverage", "ids_match", "finite", "consistent", "spot_check"], True
    )


def test_a_token_row_without_a_sample_fails_coverage(extracted):
    layout, s = extracted
    tokens = pl.read_parquet(layout.tokens)
    extra = tokens.head(1).with_columns(pl.lit("never-extracted").alias("id"))
    pl.concat([tokens, extra]).write_parquet(layout.tokens)
    assert verdicts(layout, s)["coverage"] is False


def test_ids_that_are_not_the_token_rows_fail(extracted):
    layout, s = extracted
    tokens = pl.read_parquet(layout.tokens)
    shifted = tokens.with_columns(
        pl.when(pl.int_range(pl.len()) == 0)
        .then(pl.col("input_ids").list.shift(1).list.eval(pl.element().fill_null(0)))
        .otherwise(pl.col("input_ids"))
        .alias("input_ids")
    )
    shifted.write_parquet(layout.tokens)
    assert verdicts(layout, s)["ids_match"] is False
    # ... and a loss mask shifted by one against the same ids
    tokens.with_columns(pl.col("loss_mask").list.shift(1).list.eval(pl.element().fill_null(0))).write_parquet(
        layout.tokens
    )
    assert verdicts(layout, s)["ids_match"] is False


def test_a_nan_fails_finite(extracted):
    layout, s = extracted

    def poison(t, _meta):
        t["aux_hidden_states"][3, 7] = float("nan")

    rewrite_shard(layout.hidden_states_dir, poison)
    assert verdicts(layout, s)["finite"] is False


def test_a_shard_from_another_extraction_fails_consistency(extracted):
    layout, s = extracted

    def other_layers(_t, meta):
        meta["aux_layers"] = json.dumps([2, 15, 27])

    rewrite_shard(layout.hidden_states_dir, other_layers)
    assert verdicts(layout, s)["consistent"] is False


def test_a_truncated_tensor_fails_consistency(extracted):
    layout, s = extracted

    def cut(t, _meta):
        t["last_hidden_state"] = t["last_hidden_state"][:-1].contiguous()

    rewrite_shard(layout.hidden_states_dir, cut)
    assert verdicts(layout, s)["consistent"] is False


def test_states_shifted_by_one_position_fail_the_spot_check(extracted):
    layout, s = extracted

    def shift(t, _meta):
        for k in ("aux_hidden_states", "last_hidden_state"):
            t[k] = torch.roll(t[k], 1, dims=0).contiguous()

    for name in finished_shards(layout.hidden_states_dir):
        path = layout.hidden_states_dir / name
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
            meta = dict(f.metadata())
        shift(tensors, meta)
        save_file(tensors, str(path), metadata=meta)
    v = verdicts(layout, s)
    assert (
        v["spot_check"] is False and v["ids_match"] and v["consistent"]
    )  # only an independent forward sees it


def test_states_of_other_samples_fail_the_spot_check(extracted):
    layout, s = extracted

    def first_samples_states_everywhere(t, _meta):
        """Every sample gets the first sample's states (tiled to its length): right shapes, wrong samples."""
        cu = t["cu_seqlens"].tolist()
        for key in ("aux_hidden_states", "last_hidden_state"):
            first = t[key][cu[0] : cu[1]]
            parts = [first.repeat(-(-(b - a) // len(first)), 1)[: b - a] for a, b in itertools.pairwise(cu)]
            t[key] = torch.cat(parts).contiguous()

    for name in finished_shards(layout.hidden_states_dir):
        rewrite_shard(layout.hidden_states_dir, first_samples_states_everywhere, name)
    v = verdicts(layout, s)
    assert v["spot_check"] is False and v["consistent"] and v["ids_match"]
