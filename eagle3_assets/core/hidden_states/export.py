"""Export packed hidden-state shards to the layouts the training frameworks read, with what each needs beside them.

Every layout below was checked by running the framework's own code on it (tests/consumers/: speculators 0.9.0,
SpecForge 0.2.0, Model-Optimizer 0.47.0, each in its own environment):

- speculators: an HF Arrow dataset saved in torch format (`set_format("torch")`, as speculators' data preparation
  saves it: its `ArrowDataset` compares the ids with `torch.equal`) with `input_ids`, `loss_mask` (int64 lists),
  `seq_len`, `id`; `hidden_states/hs_{i}.safetensors` for row i holding `hidden_states` [S, 4, H] (the three aux
  layers, then the last layer before the final norm) and `token_ids` [S] int64; `token_freq.pt` ({token id: count}
  over the trained tokens), from which `--draft-vocab-size` builds the draft vocabulary.
- SpecForge: `rows_{k}-{k+2000}/data_{i}.ckpt`, a `torch.save` dict with `input_ids` [S] int64, `loss_mask` [S]
  int64, `hidden_state` [1, S, H] *after* the final norm (its target head is the LM head alone) and
  `aux_hidden_state` [1, S, 3H]; `vocab_mapping/vocab_mapping.pt` (`d2t`, `t2d` for `draft_vocab_size` tokens, where
  SpecForge's own preparation writes them), the matching draft `draft_config.json`, and `specforge_train.yaml`,
  a run config for `specforge train --config`.
- Model-Optimizer: `{i}-{id}.pt` with `input_ids` [S], `hidden_states` [S, H] after the final norm,
  `aux_hidden_states` [S, 3H], `loss_mask` [S], `conversation_id`. It reads every `*.pt` under the folder as a
  sample, so nothing else in this export ends in `.pt`.

FP8 shards (`hidden_states.storage_dtype: float8_e4m3fn`): the speculators export keeps FP8, as hs-connectors'
`FP8Transfer` (speculators' `--hidden-states-backend fp8`) reads it: `hidden_states` float8 [S, 4, H] with
`hidden_states_scales` float32 [S, 4, 1] beside it (one scale per token and layer, as stored). SpecForge and
Model-Optimizer read no FP8: their exports hold the dequantized states in bf16, and the manifest says so
(`dtype`, `source_dtype`, `dequantized`).

Every export also writes `manifest.json` (target model, revision, layer ids in the consumer's convention, dtype,
sample and token counts, the training command) and `eagle3_config.json` (the layer ids alone), so that a consumer can
refuse data for another target. Samples are written in the order of a hash of their id: speculators holds out the
last tenth of the rows for validation, and the shards are ordered by length. A sample left with no trained token (by a
`max_len` cut) is left out and counted, and an export left with none is refused before anything is written (`_plan`).

An export is built in a temporary folder beside `out` and swapped in whole, so a re-export never leaves files of an
earlier one behind (Model-Optimizer would read a stale `*.pt` as a sample) and a crash leaves the previous export.

Layer ids: `hidden_states.aux_layers` counts outputs of decoder layers, 0-based ([1, L//2-1, L-4] by default).
SpecForge (through SGLang, which captures the input of layer id + 1) and Model-Optimizer (forward hooks on layer
outputs) use that convention; vLLM and speculators count `output_hidden_states` indices (index j is the output of
layer j - 1, 0 the embeddings), so their ids are ours + 1.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..storage.layout import HIDDEN_STATES_INDEX
from .export_formats import (
    CONSUMER_MAX_LEN,
    SPECFORGE_RUN,
    Counts,
    modelopt_layout,
    specforge_layout,
    speculators_layout,
    write_json,
)
from .export_target import TargetFacts, read_target
from .fp8 import is_fp8
from .shards import HiddenStatesReader, finished_shards

__all__ = ["TargetFacts", "read_target"]  # the CLI reads the target through this module

FORMATS = ("speculators", "specforge", "modelopt")
DEFAULT_DRAFT_VOCAB = 32000  # SpecForge's and speculators' usual draft vocabulary; capped at the target's
MANIFEST = "manifest.json"
LAYER_CONFIG = "eagle3_config.json"
# speculators holds out the last n - int(0.9 * n) rows and refuses an empty training split.
MIN_SAMPLES = {"speculators": 2, "specforge": 1, "modelopt": 1}


class ExportError(ValueError):
    """An export the consumer could not train from; the message says why and what to do."""


# -- the samples, in export order --------------------------------------------------------------------------
def _ordered(ids: list[str]) -> list[str]:
    return sorted(ids, key=lambda sid: hashlib.blake2b(sid.encode(), digest_size=8).digest())


def _needed_lengths(folder: Path) -> dict[str, tuple[int, int | None]]:
    """id -> (tokens, the shortest cut that keeps one trained token before the sample's last; None: no such cut),
    from the shards' loss masks alone (a few bytes a token; the states are not read)."""
    import numpy as np
    import polars as pl
    from safetensors import safe_open

    index = pl.read_parquet(folder / HIDDEN_STATES_INDEX)
    out: dict[str, tuple[int, int | None]] = {}
    for (shard,), rows in index.group_by("shard"):
        with safe_open(str(folder / shard), framework="np") as f:
            cu, mask = f.get_tensor("cu_seqlens"), f.get_tensor("loss_mask")
        for sid, pos in rows.select("id", "position").iter_rows():
            m = mask[int(cu[pos]) : int(cu[pos + 1])]
            trained = np.flatnonzero(m[:-1])  # SpecForge never trains the last position (no next token)
            out[sid] = (len(m), int(trained[0]) + 2 if trained.size else None)
    return out


def _plan(folder: Path, fmt: str, max_len: int | None, counts: Counts) -> list[str]:
    """The ids to export, in export order, or an ExportError when what is left trains nothing.

    A sample whose cut leaves no trained token (none before its last position, which SpecForge never trains) is
    left out rather than exported with an empty loss mask: no consumer learns from it and none skips it either.
    speculators and SpecForge divide by a clamped mask sum, so a batch of such samples trains nothing and reports a
    loss of 0.0 (speculators trained an export of only such samples at loss 0.0, without a warning), and a few of
    them still dilute each batch they share. Left out, they are counted (`dropped_samples` in the manifest, a log
    line) and the manifest's `samples` is what a consumer reads."""
    needed = _needed_lengths(folder)
    kept = [
        sid for sid, (_n, need) in needed.items() if need is not None and (max_len is None or need <= max_len)
    ]
    counts.dropped = len(needed) - len(kept)
    if len(kept) >= MIN_SAMPLES[fmt]:
        return _ordered(kept)
    cut = f"after the cut to max_len {max_len}" if max_len is not None else "before its last position"
    enough = sorted(need for _n, need in needed.values() if need is not None)
    k = MIN_SAMPLES[fmt]
    if not kept:
        what = (
            f"none of its {len(needed)} samples keeps a trained (loss-mask) token {cut}: nothing to train on"
        )
    else:
        what = (
            f"only {len(kept)} of its {len(needed)} samples keeps a trained (loss-mask) token {cut}, and {fmt} "
            f"needs at least {k} (it holds out the last tenth for validation)"
        )
    fix = (
        f"use max_len >= {enough[k - 1]} to keep {k} sample{'s' if k > 1 else ''}, >= {enough[-1]} to keep every "
        "sample with a trained token, or no max_len to export every sample whole"
        if len(enough) >= k
        else "answer more prompts and materialise tokens and hidden_states again"
    )
    raise ExportError(f"{folder}: {what}; {fix}")


@dataclass(frozen=True)
class StatesAs:
    """How an export holds the states: as stored (`raw`: FP8 with its scales), or read dequantized and cast to
    `dtype` (None: as the reader returns them)."""

    raw: bool = False
    dtype: str | None = None

    @classmethod
    def of(cls, fmt: str, source_dtype: str) -> StatesAs:
        if not is_fp8(source_dtype):
            return cls()
        return cls(raw=True) if fmt == "speculators" else cls(dtype="bfloat16")

    def read(self, reader: HiddenStatesReader, sid: str) -> dict[str, Any]:
        import torch

        s = reader.sample(sid, raw=self.raw)
        if self.dtype is not None:
            for k in ("aux_hidden_states", "last_hidden_state"):
                s[k] = s[k].to(getattr(torch, self.dtype))
        return s

    def manifest(self, source_dtype: str) -> dict[str, Any]:
        if not is_fp8(source_dtype):
            return {"dtype": source_dtype}
        if self.raw:
            return {
                "dtype": source_dtype,
                "source_dtype": source_dtype,
                "dequantized": False,
                "scales": "hidden_states_scales float32 [S, 4, 1]: hidden_states.float() * hidden_states_scales "
                "(hs-connectors FP8Transfer; speculators --hidden-states-backend fp8)",
            }
        return {
            "dtype": self.dtype,
            "source_dtype": source_dtype,
            "dequantized": True,
            "note": f"this framework reads no FP8: the {source_dtype} shards were dequantized (values x their "
            f"per-token, per-layer scales) and stored in {self.dtype}",
        }


def _samples(
    reader: HiddenStatesReader,
    ids: list[str],
    max_len: int | None,
    counts: Counts,
    freq: Counter[int],
    states: StatesAs = StatesAs(),
) -> Iterator[tuple[int, str, dict[str, Any]]]:
    """(i, id, sample) in export order, cut to `max_len` tokens, counting tokens and trained token ids as they pass."""
    import torch

    for i, sid in enumerate(ids):
        s = states.read(reader, sid)
        n = int(s["input_ids"].shape[0])
        counts.longest_source = max(counts.longest_source, n)
        if max_len is not None and n > max_len:
            s = {k: v[:max_len] for k, v in s.items()}
            counts.truncated += 1
            n = max_len
        counts.longest = max(counts.longest, n)
        tokens, mask = s["input_ids"].long(), s["loss_mask"].long()
        trained = tokens[mask.bool()]
        values, times = torch.unique(trained, return_counts=True)
        freq.update(dict(zip(values.tolist(), times.tolist(), strict=True)))
        counts.samples += 1
        counts.tokens += n
        counts.loss_tokens += int(trained.numel())
        yield i, sid, {**s, "input_ids": tokens, "loss_mask": mask}


# -- the export ----------------------------------------------------------------------------------------------
def export(
    folder: Path,
    out: Path,
    fmt: str,
    log: Callable[[str], None] = print,
    *,
    target: TargetFacts | None = None,
    max_len: int | None = None,
    draft_vocab_size: int = DEFAULT_DRAFT_VOCAB,
) -> int:
    """Write every sample of a dataset's hidden_states folder to `out` in `fmt`; returns the sample count.

    `target` defaults to the model the shards name (resolvable when it is a builtin, a hub id or an absolute
    path); `max_len` cuts longer samples (ids, mask and states alike) where a consumer would cut them anyway;
    `draft_vocab_size` sizes the draft vocabulary of the side files (capped at the target's vocabulary)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if max_len is not None and max_len < 2:
        raise ExportError(f"max_len {max_len} leaves nothing to train on: use at least 2 tokens")
    folder, out = Path(folder), Path(out).resolve()  # the side files name their paths absolutely
    metas = list(finished_shards(folder).values())
    reader = HiddenStatesReader(folder) if (folder / HIDDEN_STATES_INDEX).exists() else None
    n = len(reader) if reader is not None else 0
    if n < MIN_SAMPLES[fmt]:
        need = "at least 2 samples (it holds out the last tenth for validation and refuses an empty training split)"
        raise ExportError(
            f"{folder} holds {n} hidden-state sample(s): {fmt} needs "
            + (need if fmt == "speculators" else "at least one")
            + "; answer more prompts and materialise tokens and hidden_states first"
        )
    assert reader is not None
    counts, freq = Counts(), Counter[int]()
    ids = _plan(folder, fmt, max_len, counts)  # refuses an export that trains nothing before writing anything
    if target is None:
        target = read_target(metas[0]["model"], metas[0].get("revision") or None)
    _check_out(out)
    work = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    work.mkdir()  # not mkdtemp: the export's folders get the user's umask, not 0700
    source_dtype = str(metas[0].get("dtype", ""))
    states = StatesAs.of(fmt, source_dtype)
    try:
        samples = _samples(reader, ids, max_len, counts, freq, states)
        side = {
            "speculators": speculators_layout,
            "specforge": specforge_layout,
            "modelopt": modelopt_layout,
        }[fmt](samples, folder, work)
        side_files = side(work, out, target, freq, counts, draft_vocab_size) if side else {}
        layers = layer_config(folder, fmt)
        write_json(layers, work / LAYER_CONFIG)
        manifest = _manifest(fmt, metas[0], layers, target, counts, max_len, side_files, out)
        manifest.update(states.manifest(source_dtype))
        if states.raw:  # speculators reads FP8 files through hs-connectors' FP8Transfer
            manifest["train_command"] += " --hidden-states-backend fp8"
        write_json(manifest, work / MANIFEST)
        _swap_in(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        work.with_name(work.name + ".rows.arrow").unlink(missing_ok=True)
    log(
        f"exported {counts.samples} samples ({counts.tokens:,} tokens, {counts.loss_tokens:,} trained) from {folder} "
        f"to {out} ({fmt})"
    )
    if counts.truncated:
        log(f"{counts.truncated} samples longer than {max_len} tokens were cut to {max_len}")
    if counts.dropped:
        log(
            f"{counts.dropped} samples were left out: no trained token before their last position"
            + (f" after the cut to {max_len}" if max_len is not None else "")
            + " (manifest.json: dropped_samples)"
        )
    default = CONSUMER_MAX_LEN[fmt]
    if counts.longest > default:
        log(
            f"the longest sample has {counts.longest} tokens, more than {fmt} keeps by default ({default}): "
            "the command in manifest.json raises its limit"
        )
    return counts.samples


def _check_out(out: Path) -> None:
    if (
        out.exists()
        and any(out.iterdir())
        and not (out / MANIFEST).exists()
        and not (out / LAYER_CONFIG).exists()
    ):
        raise ExportError(f"{out} is not empty and holds no earlier export: choose a new or empty folder")
    out.parent.mkdir(parents=True, exist_ok=True)


def _swap_in(work: Path, out: Path) -> None:
    """Replace `out` (an earlier export, or nothing) with `work` in two renames."""
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    if out.exists():
        os.replace(out, old)
    os.replace(work, out)
    shutil.rmtree(old, ignore_errors=True)


def layer_config(folder: Path, fmt: str) -> dict[str, Any]:
    """The aux layer ids in the key and the convention `fmt` reads them in."""
    metas = list(finished_shards(folder).values())
    if not metas:
        raise FileNotFoundError(f"no hidden-state shards in {folder}")
    aux = json.loads(metas[0]["aux_layers"])
    num_layers = int(metas[0]["num_layers"])
    if fmt == "speculators":
        ids = [i + 1 for i in aux]
        convention = (
            "output_hidden_states indices (id j = output of decoder layer j - 1; 0 = embeddings), as vLLM"
        )
    else:
        ids = list(aux)
        convention = "outputs of decoder layers, 0-based" + (
            " (SGLang captures the input of layer id + 1)" if fmt == "specforge" else " (forward hooks)"
        )
    last = "before the final norm" if fmt == "speculators" else "after the final norm"
    return {
        "format": fmt,
        "eagle_aux_hidden_state_layer_ids": ids,
        "layer_convention": convention,
        "num_hidden_layers": num_layers,
        "last_hidden_state": f"output of decoder layer {num_layers - 1}, {last}",
        "model": metas[0].get("model"),
        "revision": metas[0].get("revision") or None,
    }


def _manifest(
    fmt: str,
    meta: dict[str, Any],
    layers: dict[str, Any],
    target: TargetFacts,
    counts: Counts,
    max_len: int | None,
    side_files: dict[str, Any],
    out: Path,
) -> dict[str, Any]:
    from importlib.metadata import version

    limit = max(CONSUMER_MAX_LEN[fmt], counts.longest)
    return {
        "format": fmt,
        "producer": f"eagle3-assets {version('eagle3-assets')}",
        "target": {
            "model": meta.get("model"),
            "revision": meta.get("revision") or None,
            "tokenizer": meta.get("tokenizer"),
            "num_hidden_layers": int(meta["num_layers"]),
            "hidden_size": int(target.config.hidden_size),
            "vocab_size": target.vocab_size,
        },
        "aux_layer_ids": layers["eagle_aux_hidden_state_layer_ids"],
        "layer_convention": layers["layer_convention"],
        "last_hidden_state": layers["last_hidden_state"],
        "dtype": meta.get("dtype"),
        "samples": counts.samples,
        "tokens": counts.tokens,
        "trained_tokens": counts.loss_tokens,
        "longest_sample": counts.longest,
        "longest_source_sample": counts.longest_source,
        "max_len": max_len,
        "truncated_samples": counts.truncated,
        "dropped_samples": counts.dropped,  # no trained token left (see _plan); not in `samples`
        "files": side_files,
        "train_command": _train_command(fmt, layers, target, out, side_files, limit),
    }


def _train_command(
    fmt: str, layers: dict[str, Any], target: TargetFacts, out: Path, side: dict[str, Any], limit: int
) -> str:
    ids = layers["eagle_aux_hidden_state_layer_ids"]
    if fmt == "speculators":
        return (
            f"speculators train --verifier-name-or-path {target.path} --data-path {out} "
            f"--target-layer-ids {' '.join(map(str, ids))} --draft-vocab-size {side['draft_vocab_size']} "
            f"--total-seq-len {limit} --on-missing raise --save-path ./checkpoints"
        )
    if fmt == "specforge":
        return f"specforge train --config {out / SPECFORGE_RUN}"
    return (
        "./launch_train.sh --config ../../modelopt_recipes/general/speculative_decoding/eagle3.yaml "
        f"model.model_name_or_path={target.path} data.offline_data_path={out} training.output_dir=./checkpoints "
        f"training.training_seq_len={limit} training.answer_only_loss=true "
        f"'eagle.eagle_architecture_config.eagle_aux_hidden_state_layer_ids=[{','.join(map(str, ids))}]'"
        "  # in examples/speculative_decoding of a Model-Optimizer checkout"
    )
