"""One export: refuse what no consumer could train from before writing anything, write the layout in a
temporary folder beside `out` and swap it in whole (a re-export never leaves files of an earlier one
behind, and a crash leaves the previous export)."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

from ...storage.layout import HIDDEN_STATES_INDEX
from ..reader import HiddenStatesReader, StoredStates
from .base import Counts, ExportError, ExportFormat, ExportJob, write_json
from .manifest import LAYER_CONFIG, MANIFEST, LayerConfig, manifest
from .modelopt import ModelOpt
from .samples import StatesAs, export_samples, plan_samples
from .specforge import SpecForge
from .speculators import Speculators
from .target import TargetFacts, read_target

FORMATS: dict[str, ExportFormat] = {f.name: f for f in (Speculators(), SpecForge(), ModelOpt())}
DEFAULT_DRAFT_VOCAB = 32000  # SpecForge's and speculators' usual draft vocabulary; capped at the target's


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
    layout = FORMATS[fmt]
    if max_len is not None and max_len < 2:
        raise ExportError(f"max_len {max_len} leaves nothing to train on: use at least 2 tokens")
    folder, out = Path(folder), Path(out).resolve()  # the side files name their paths absolutely
    reader = _reader(folder, layout)
    counts = Counts()
    ids = plan_samples(
        folder, layout, max_len, counts
    )  # refuses an export that trains nothing before writing
    source = StoredStates.read(folder)
    states = StatesAs.of(layout, source.dtype)
    if target is None:
        if source.model is None:
            raise ExportError(
                f"{folder}: the shards name no target model; pass the target's facts explicitly"
            )
        target = read_target(source.model, source.revision)
    _check_out(out)
    work = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
    work.mkdir()  # not mkdtemp: the export's folders get the user's umask, not 0700
    job = ExportJob(folder, work, out, source, target, draft_vocab_size, states.raw, counts)
    try:
        files = layout.write(export_samples(reader, ids, max_len, states, job), job)
        layers = LayerConfig.of(layout, source)
        write_json(layers.to_json(), work / LAYER_CONFIG)
        entries = states.manifest(source.dtype)
        write_json(manifest(layout, job, layers, max_len, files, entries), work / MANIFEST)
        _swap_in(work, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _log_summary(layout, job, max_len, log)
    return job.counts.samples


def _reader(folder: Path, fmt: ExportFormat) -> HiddenStatesReader:
    """The folder's samples, refused when fewer than the consumer trains from."""
    reader = HiddenStatesReader(folder) if (folder / HIDDEN_STATES_INDEX).exists() else None
    n = len(reader) if reader is not None else 0
    if reader is None or n < fmt.min_samples:
        raise ExportError(
            f"{folder} holds {n} hidden-state sample(s): {fmt.name} needs {fmt.needs}; answer more prompts "
            "and materialise tokens and hidden_states first"
        )
    return reader


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


def _log_summary(fmt: ExportFormat, job: ExportJob, max_len: int | None, log: Callable[[str], None]) -> None:
    counts = job.counts
    log(
        f"exported {counts.samples} samples ({counts.tokens:,} tokens, {counts.loss_tokens:,} trained) from "
        f"{job.folder} to {job.out} ({fmt.name})"
    )
    if counts.truncated:
        log(f"{counts.truncated} samples longer than {max_len} tokens were cut to {max_len}")
    if counts.dropped:
        log(
            f"{counts.dropped} samples were left out: no trained token before their last position"
            + (f" after the cut to {max_len}" if max_len is not None else "")
            + " (manifest.json: dropped_samples)"
        )
    default = fmt.consumer_max_len
    if counts.longest > default:
        log(
            f"the longest sample has {counts.longest} tokens, more than {fmt.name} keeps by default "
            f"({default}): the command in manifest.json raises its limit"
        )
