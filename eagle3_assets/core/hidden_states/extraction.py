"""The hidden-states job of one dataset: plan what is left, extract shards (one or many per process), index.

Split so that Dagster can fan the shards out over many GPU pods: `prepare` runs once, `extract` runs per unit
of work (any subset of the planned shards), `finish` rebuilds the index from the shards on disk. Two engines
behind `extract` (`hidden_states.engine`): the target in this process (transformers), or running vLLM servers
(`served.py`; the caller passes their backend), both writing the same shards.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from ...config import HiddenStatesConfig, ProjectConfig, TargetConfig
from ..generation.engine_settings import EngineSettings
from ..generation.protocol import InferenceBackend
from ..storage.files import write_json
from ..storage.layout import EXTRACTION_PLAN, HIDDEN_STATES_INDEX, DatasetLayout
from ..target_model.loading import pick_device, resolve, shared_model
from ..target_model.pieces import local_checkpoint
from .capture import HiddenStateCapture, packing_is_exact
from .final_norm import save_final_norm, save_final_norm_from_checkpoint
from .fp8 import FP8_SCALES, is_fp8
from .layer_ids import configured_aux_layers
from .served import extract_served
from .shards import (
    ExtractionStats,
    ShardPlan,
    ShardWriter,
    WorkPlan,
    bytes_per_token,
    extract_shard,
    load_samples,
    plan_work,
    row_budget,
    set_aside_damaged,
    shard_files,
    write_index,
)
from .sizing import PlannedBytes, ensure_room

# What a shard holds, not how it is named: a shard that differs in these is recomputed (changing storage_dtype
# or the layers recomputes every shard). A changed model, revision or tokenizer name is left to the
# consistency check, which fails naming it: a renamed path to the same checkpoint must not delete terabytes of
# states.
RECOMPUTE_ON = ("dtype", "aux_layers")


class ExtractionIncomplete(RuntimeError):
    """Some samples failed after their retries; the shards that completed are stored and are not redone."""


@dataclass(frozen=True)
class ExtractionSettings:
    """The sections of eagle3.yaml extraction reads, and the folder relative references resolve against."""

    target: TargetConfig = field(default_factory=TargetConfig)
    hidden: HiddenStatesConfig = field(default_factory=HiddenStatesConfig)
    base_dir: str = "."

    @classmethod
    def from_config(cls, cfg: ProjectConfig) -> ExtractionSettings:
        return cls(cfg.target, cfg.hidden_states, cfg.base_dir)

    def aux_layers(self, num_layers: int) -> list[int]:
        """The aux layers extracted from a target of `num_layers` decoder layers."""
        return configured_aux_layers(self.hidden, num_layers)

    @property
    def store_dtype(self) -> str:
        """What the shards store (`hidden_states.storage_dtype`); compute runs in the device's own dtype."""
        return self.hidden.storage_dtype

    @property
    def model_ref(self) -> str:
        return resolve(self.target.model, self.base_dir)


def load_target_model(settings: ExtractionSettings) -> Any:
    """The target on the configured device, once per process (`shared_model`)."""
    t = settings.target
    return shared_model(
        settings.model_ref, pick_device(settings.hidden.device), t.trust_remote_code, t.revision
    )


def model_config(settings: ExtractionSettings) -> dict[str, Any]:
    """num_layers, hidden_size and context from config.json, without loading weights (planning needs only
    sizes)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(
        settings.model_ref,
        trust_remote_code=settings.target.trust_remote_code,
        revision=settings.target.revision,
    )
    text = getattr(cfg, "text_config", None) or cfg
    return {
        "num_layers": int(text.num_hidden_layers),
        "hidden_size": int(text.hidden_size),
        "max_position_embeddings": int(getattr(text, "max_position_embeddings", 0) or 1 << 30),
    }


def expected_metadata(settings: ExtractionSettings, num_layers: int | None = None) -> dict[str, str]:
    """What every shard of this configuration must say about itself (the hidden_states checks compare)."""
    if num_layers is None:
        num_layers = model_config(settings)["num_layers"]
    aux = settings.aux_layers(num_layers)
    t = settings.target
    return {
        "model": t.model,
        "revision": t.revision or "",
        "tokenizer": t.tokenizer,
        "aux_layers": json.dumps(aux),
        "dtype": settings.store_dtype,  # the storage dtype: a shard stored in another is stale
        "num_layers": str(num_layers),
        **({"scales": FP8_SCALES} if is_fp8(settings.store_dtype) else {}),
    }


def why_target_cannot_run_here(settings: ExtractionSettings) -> str | None:
    """None when the target can be loaded in this process for the spot check's independent forward; else why
    not (a served target of a trillion parameters does not fit the machine that checks its states)."""
    root = local_checkpoint(settings.model_ref, settings.target.revision)
    if root is None:
        return f"no local copy of {settings.target.model}'s checkpoint on this machine"
    size = sum(p.stat().st_size for p in root.glob("*.safetensors")) or sum(
        p.stat().st_size for p in root.glob("*.bin")
    )
    device = pick_device(settings.hidden.device)
    if device.startswith("cuda"):
        import torch

        room = sum(torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count()))
        where = f"{torch.cuda.device_count()} GPU(s)"
    else:
        room = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        where = "free host memory"
    if size * 1.2 > room:  # weights in their stored dtype, plus activations and the framework's own
        return (
            f"the checkpoint ({size / 1e9:,.0f} GB) does not fit this machine's {where} "
            f"({room / 1e9:,.0f} GB)"
        )
    return None


def skipped_samples(layout: DatasetLayout) -> dict[str, str]:
    """Samples the last plan left out, with the reason (longer than hidden_states.max_seq_len)."""
    path = layout.extraction_plan
    return json.loads(path.read_text()).get("skipped", {}) if path.exists() else {}


def prepare(
    layout: DatasetLayout,
    settings: ExtractionSettings,
    log: Callable[[str], None] = print,
    check_space: bool = True,
) -> WorkPlan:
    """Plan the shards still to extract and write the plan beside the shards (extract steps read it), with the
    bytes they will take; with `check_space` (a local storage root), refuse a plan larger than the free space
    (`sizing.NotEnoughSpace`) before any forward."""
    folder = layout.hidden_states_dir
    folder.mkdir(parents=True, exist_ok=True)
    sizes = model_config(settings)
    tokens = pl.read_parquet(layout.tokens, columns=["id", "input_ids"])
    expected = expected_metadata(settings, sizes["num_layers"])
    n_layers = len(json.loads(expected["aux_layers"])) + 1
    per_token = bytes_per_token(sizes["hidden_size"], settings.store_dtype, n_layers)
    set_aside = set_aside_damaged(layout.dir, folder)  # their samples are planned again like any missing one
    for q in set_aside:
        log(f"{layout.key}: set aside {q.describe()}")
    hidden = settings.hidden
    same = {k: expected[k] for k in RECOMPUTE_ON}
    work = plan_work(tokens, folder, hidden.shard_bytes, per_token, hidden.max_seq_len, same)
    work.set_aside = set_aside
    planned = PlannedBytes(
        tokens=sum(p.n_tokens for p in work.todo),
        samples=sum(len(p.ids) for p in work.todo),
        shards=len(work.todo),
        hidden_size=sizes["hidden_size"],
        stored_layers=n_layers,
        storage_dtype=settings.store_dtype,
    )
    work.planned = planned.metadata()
    log(f"{layout.key}: the planned shards will take {planned.describe()}")
    for name in work.stale_shards:  # before the space is measured: what they held is free for the new shards
        (folder / name).unlink(missing_ok=True)
    if check_space and work.todo:
        work.planned["free_bytes"] = ensure_room(folder, planned)
    write_json(
        {
            "created_at": time.time(),
            "shards": {p.name: list(p.ids) for p in work.todo},
            "skipped": work.skipped,
            "planned": work.planned,
        },
        folder / EXTRACTION_PLAN,
    )
    log(
        f"{layout.key}: {len(work.done_ids):,} samples already extracted, {planned.samples:,} to do in "
        f"{len(work.todo)} shards; {len(work.stale_shards)} stale shards removed, {len(work.skipped)} "
        "samples too long"
    )
    return work


def planned_shards(layout: DatasetLayout) -> list[ShardPlan]:
    data = json.loads((layout.extraction_plan).read_text())
    return [ShardPlan(name, tuple(ids), 0) for name, ids in data["shards"].items()]


def extract(
    layout: DatasetLayout,
    settings: ExtractionSettings,
    shard_names: list[str] | None = None,
    log: Callable[[str], None] = print,
    served: InferenceBackend | None = None,
) -> ExtractionStats:
    """Extract the planned shards (all, or the named ones) that are not on disk yet; with engine vllm, through
    `served` (the servers' backend)."""
    folder = layout.hidden_states_dir
    plans = [p for p in planned_shards(layout) if shard_names is None or p.name in shard_names]
    plans = [p for p in plans if not (folder / p.name).exists()]  # finished by an earlier attempt
    stats = ExtractionStats()
    if not plans:
        return stats
    if settings.hidden.engine == "vllm":
        if served is None:
            raise ValueError("hidden_states.engine is vllm: pass the servers' backend (resources.vllm)")
        return _extract_served(layout, settings, plans, served, log)
    device = pick_device(settings.hidden.device)
    model = load_target_model(settings)
    num_layers = model.config.get_text_config().num_hidden_layers
    aux = settings.aux_layers(num_layers)
    capture = HiddenStateCapture(model, aux)
    attn = getattr(model.config, "_attn_implementation", None)
    row_tokens = row_budget(device, attn, settings.hidden.max_tokens_per_batch)
    packed, similarity = _packing_verdict(capture, model)
    if not packed:
        log(
            f"{layout.key}: WARNING: this model's attention ignores packed sample boundaries (a packed "
            f"forward of two samples differs from separate ones, cosine {similarity:.4f}); extracting one "
            "sample per forward instead (slower, never mixed samples)"
        )
        row_tokens = 1  # every sample in a row of its own
    metadata = {
        **expected_metadata(settings, num_layers),
        "aux_layers": json.dumps(aux),
        "last_layer": str(capture.last_layer),
        "layer_convention": "outputs of decoder layers (0-based); last_hidden_state is before the final norm",
        "hidden_size": str(model.config.get_text_config().hidden_size),
        "packing": "packed" if packed else "one sample per forward (the model ignores packed boundaries)",
        "engine": "transformers",
        "compute_dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
    }
    save_final_norm(model, folder)
    samples = load_samples(layout.tokens, {i for p in plans for i in p.ids})
    writer = ShardWriter()
    started = time.monotonic()
    try:
        for k, plan in enumerate(plans, 1):
            plan = ShardPlan(plan.name, plan.ids, sum(len(samples[i].input_ids) for i in plan.ids))
            stats.merge(
                extract_shard(
                    capture, plan, samples, folder, row_tokens, settings.store_dtype, metadata, writer
                )
            )
            elapsed = max(time.monotonic() - started, 1e-9)
            log(
                f"{layout.key}: shard {k}/{len(plans)} ({plan.n_tokens:,} tokens) queued for writing; "
                f"{stats.tokens / elapsed:,.0f} tok/s so far on {device}"
            )
    finally:
        writer.close()  # every queued shard is on disk (or the error surfaces) before this returns
        capture.close()
    stats.bytes_written = sum((folder / n).stat().st_size for n in stats.shards)
    return stats


def _extract_served(
    layout: DatasetLayout,
    settings: ExtractionSettings,
    plans: list[ShardPlan],
    backend: InferenceBackend,
    log: Callable[[str], None],
) -> ExtractionStats:
    folder = layout.hidden_states_dir
    sizes = model_config(settings)
    num_layers = sizes["num_layers"]
    aux = settings.aux_layers(num_layers)
    cfg = settings.hidden.vllm
    metadata = {
        **expected_metadata(settings, num_layers),
        "aux_layers": json.dumps(aux),
        "last_layer": str(num_layers - 1),
        "layer_convention": "outputs of decoder layers (0-based); last_hidden_state is before the final norm",
        "hidden_size": str(sizes["hidden_size"]),
        "packing": "one sample per request (served)",
        "engine": "vllm",
    }
    if not save_final_norm_from_checkpoint(settings.model_ref, folder, settings.target.revision):
        log(
            f"{layout.key}: the target's final norm is not readable here (no local checkpoint of "
            f"{settings.target.model}); exports that store post-norm last states will ask for it"
        )
    samples = load_samples(layout.tokens, {i for p in plans for i in p.ids})
    plans = [ShardPlan(p.name, p.ids, sum(len(samples[i].input_ids) for i in p.ids)) for p in plans]
    engine = EngineSettings(  # twice the servers' slots: requests waiting for their files hold no server slot
        max_concurrency=2 * cfg.max_concurrency,
        initial_concurrency=2 * cfg.max_concurrency,
        max_retries=cfg.max_retries,
        backoff_max_s=30.0,
        stall_timeout_s=cfg.request_timeout_s,
    )
    log(
        f"{layout.key}: extracting {sum(p.n_tokens for p in plans):,} tokens in {len(plans)} shards through "
        f"{len(cfg.base_urls)} vLLM server(s), up to {cfg.max_concurrency} requests in flight"
    )
    result = extract_served(
        backend, plans, samples, folder, settings.store_dtype, metadata, len(aux), engine, log
    )
    if result.too_long:
        plan = json.loads(layout.extraction_plan.read_text())
        plan["skipped"] = {**plan.get("skipped", {}), **result.too_long}
        write_json(plan, layout.extraction_plan)
    stats = result.stats
    log(
        f"{layout.key}: {stats.samples:,} samples ({stats.tokens:,} tokens) in {len(stats.shards)} shards, "
        f"{stats.tokens / max(stats.forward_s, 1e-9):,.0f} tok/s; {len(result.too_long)} refused as too "
        f"long, {len(result.failed)} failed"
    )
    if result.failed:
        examples = "; ".join(f"{k}: {v}" for k, v in list(result.failed.items())[:3])
        raise ExtractionIncomplete(
            f"{len(result.failed)} samples failed after their retries ({examples}); the {len(stats.shards)} "
            f"shards that completed are stored, the {len(result.unfinished_shards)} others are extracted "
            "again by the next materialisation"
        )
    return stats


_PACKING: dict[int, tuple[bool, float]] = {}


def _packing_verdict(capture: HiddenStateCapture, model: Any) -> tuple[bool, float]:
    """The packing self-test, once per loaded model and process."""
    key = id(model)
    if key not in _PACKING:
        _PACKING[key] = packing_is_exact(capture, int(model.config.get_text_config().vocab_size))
    return _PACKING[key]


def finish(layout: DatasetLayout) -> pl.DataFrame:
    """Rebuild the index from the shards (a damaged shard that appeared since the plan is set aside first)."""
    set_aside_damaged(layout.dir, layout.hidden_states_dir)
    return write_index(layout.hidden_states_dir)


def extract_dataset(
    layout: DatasetLayout,
    settings: ExtractionSettings,
    log: Callable[[str], None] = print,
    served: InferenceBackend | None = None,
) -> tuple[WorkPlan, ExtractionStats, pl.DataFrame]:
    """All three steps in one process (CLI, tests, a single-GPU machine)."""
    work = prepare(layout, settings, log)
    stats = extract(layout, settings, None, log, served)
    return work, stats, finish(layout)


def describe_layout(folder: Path) -> dict[str, Any]:
    index = pl.read_parquet(folder / HIDDEN_STATES_INDEX) if (folder / HIDDEN_STATES_INDEX).exists() else None
    shards = shard_files(folder)
    return {
        "samples": 0 if index is None else index.height,
        "tokens": 0 if index is None else int(index["n_tokens"].sum()),
        "shards": len(shards),
        "bytes": sum(p.stat().st_size for p in shards),
    }
