"""hidden_states: the target's auxiliary hidden states over every token sequence, in packed safetensors
shards.

Layout: each shard holds samples back to back: `input_ids` [T] int32, `loss_mask` [T] int8,
`aux_hidden_states` [T, 3H], `last_hidden_state` [T, H] (output of the last decoder layer, before the final
norm), `cu_seqlens` [n+1] int64; its metadata names the model, layers, dtype and every sample (id, length,
content hash). In FP8 (`storage_dtype: float8_e4m3fn`) the two state tensors are float8 with `<name>_scales`
[T, n] float32 beside them (fp8.py). Shards are written atomically, so a crash never leaves a partial shard
that looks finished; a finished shard is never recomputed. `index.parquet` (id, shard, position, n_tokens) is
rebuilt from the shards' own metadata.

Throughput: samples are sorted by length and packed back to back into rows of up to a token budget, with
position ids restarting per sample (block-diagonal attention; flash-attention's varlen kernel on GPUs), so no
compute goes to padding; the model is loaded once per process, and device-to-host copies and file writes run
on a background thread while the next forward runs.
"""

from __future__ import annotations

import functools
import hashlib
import json
import queue
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from ..storage.files import atomic_write, remove_stale_temporaries, write_parquet
from ..storage.layout import HIDDEN_STATES_INDEX
from ..storage.quarantine import (
    Quarantined,
    quarantine,
    safetensors_header,
    safetensors_problem,
    sweep_parquet,
)
from .capture import HiddenStateCapture
from .fp8 import STATE_TENSORS, is_fp8, payload_bytes_per_token, quantize_layers, scales_name

FORMAT = "eagle3-assets/hidden-states/v1"
INDEX_SCHEMA: dict[str, pl.DataType] = {
    "id": pl.String(),
    "shard": pl.String(),
    "position": pl.Int32(),
    "n_tokens": pl.Int32(),
    "input_hash": pl.String(),
    # the shard's (a reader picks FP8's dequantization per sample without opening it)
    "storage_dtype": pl.String(),
}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}
SDPA_ROW_TOKENS = {
    "cpu": 1024,
    "cuda": 4096,
}  # dense block-diagonal masks grow as T²; flash-attn needs no cap


def input_hash(ids: Sequence[int] | np.ndarray) -> str:
    """Content hash of a sample's token ids: a re-tokenized sample is recomputed, an unchanged one is not."""
    return hashlib.blake2b(np.asarray(ids, dtype=np.int32).tobytes(), digest_size=8).hexdigest()


def bytes_per_token(hidden_size: int, dtype: str, n_layers: int = 4) -> int:
    """A token's bytes in a shard: its states (the aux layers and the last; in FP8 a float32 scale per layer
    beside them), its int32 id and int8 mask."""
    return payload_bytes_per_token(hidden_size, n_layers, dtype, DTYPE_BYTES[dtype]) + 4 + 1


# -- planning ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sample:
    id: str
    input_ids: np.ndarray
    loss_mask: np.ndarray

    @property
    def hash(self) -> str:
        return input_hash(self.input_ids)


@dataclass(frozen=True)
class ShardPlan:
    name: str
    ids: tuple[str, ...]
    n_tokens: int


def shard_name(ids: Iterable[str]) -> str:
    digest = hashlib.blake2b("\n".join(ids).encode(), digest_size=8).hexdigest()
    return f"shard-{digest}.safetensors"


def plan_shards(lengths: dict[str, int], shard_bytes: int, per_token: int) -> list[ShardPlan]:
    """Deterministic shards of length-sorted samples, each under `shard_bytes` (a longer sample gets its
    own)."""
    order = sorted(lengths, key=lambda i: (lengths[i], i))
    shards: list[ShardPlan] = []
    current: list[str] = []
    tokens = 0
    for sid in order:
        n = lengths[sid]
        if current and (tokens + n) * per_token > shard_bytes:
            shards.append(ShardPlan(shard_name(current), tuple(current), tokens))
            current, tokens = [], 0
        current.append(sid)
        tokens += n
    if current:
        shards.append(ShardPlan(shard_name(current), tuple(current), tokens))
    return shards


def pack_rows(lengths: Sequence[int], row_tokens: int) -> list[list[int]]:
    """Consecutive samples (already length-sorted) packed into rows of at most `row_tokens` tokens."""
    rows: list[list[int]] = []
    current: list[int] = []
    total = 0
    for i, n in enumerate(lengths):
        if current and total + n > row_tokens:
            rows.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        rows.append(current)
    return rows


# -- reading what exists
# ---------------------------------------------------------------------------------------
def read_shard_metadata(path: Path) -> dict[str, Any]:
    from safetensors import safe_open

    with safe_open(str(path), framework="np") as f:
        meta = dict(f.metadata() or {})
    meta["samples"] = json.loads(meta.get("samples", "[]"))
    return meta


def shard_files(folder: Path) -> list[Path]:
    """The shard files in `folder`, by name (temporaries are never named *.safetensors)."""
    return sorted(folder.glob("shard-*.safetensors"))


def finished_shards(folder: Path) -> dict[str, dict[str, Any]]:
    """Shard file name -> metadata, for every complete shard (temporaries are never named *.safetensors). A
    shard cut short keeps a readable header, so its length is checked against the header too."""
    out = {}
    for path in shard_files(folder):
        try:
            if safetensors_problem(path) is not None:
                continue
            meta = read_shard_metadata(path)
        except Exception:  # unreadable: not ours or damaged outside our control; recompute its samples
            continue
        if meta.get("format") == FORMAT:
            out[path.name] = meta
    return out


def build_index(folder: Path) -> pl.DataFrame:
    rows = []
    for name, meta in finished_shards(folder).items():
        for pos, (sid, n, h) in enumerate(meta["samples"]):
            rows.append(
                {
                    "id": sid,
                    "shard": name,
                    "position": pos,
                    "n_tokens": n,
                    "input_hash": h,
                    "storage_dtype": meta.get("dtype", ""),
                }
            )
    return pl.DataFrame(rows, schema=INDEX_SCHEMA)


INDEX_REQUIRED = ["id", "shard", "position", "n_tokens"]


SHARD_TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_state", "cu_seqlens")


def shard_problem(path: Path) -> str | None:
    """Why `path` is not a whole shard of this format, or None: a whole safetensors file
    (`safetensors_problem`) with this format's metadata and tensors."""
    why = safetensors_problem(path)
    if why is not None:
        return why
    header, _ = safetensors_header(path)
    meta = (header or {}).get("__metadata__") or {}
    if meta.get("format") != FORMAT:
        return f"wrong schema: metadata format {meta.get('format')!r}, expected {FORMAT!r}"
    wanted = SHARD_TENSORS + (
        tuple(scales_name(t) for t in STATE_TENSORS) if is_fp8(meta.get("dtype", "")) else ()
    )
    missing = [t for t in wanted if t not in (header or {})]
    if missing:
        return f"wrong schema: no tensor {', '.join(missing)}"
    return None


def set_aside_damaged(partition_dir: Path, folder: Path, stage: str = "hidden_states") -> list[Quarantined]:
    """Move damaged shards (cut short, not safetensors, not this format) and a damaged index to the
    partition's quarantine folder: their samples then count as not extracted and are recomputed; the index is
    rebuilt from the shards."""
    out = []
    for path in shard_files(folder):
        why = shard_problem(path)
        if why is None:
            continue
        header, _ = safetensors_header(path)  # a shard cut short may still name the samples it held
        try:
            rows = len(json.loads(header["__metadata__"]["samples"])) if header else None
        except (KeyError, TypeError, ValueError):
            rows = None
        out.append(quarantine(partition_dir, path, why, stage, rows=rows))
    out += sweep_parquet(partition_dir, [folder / HIDDEN_STATES_INDEX], stage, INDEX_SCHEMA, INDEX_REQUIRED)
    return out


def write_index(folder: Path) -> pl.DataFrame:
    index = build_index(folder)
    write_parquet(index, folder / HIDDEN_STATES_INDEX)
    return index


@dataclass
class WorkPlan:
    todo: list[ShardPlan]
    done_ids: set[str]
    stale_shards: list[str]
    skipped: dict[str, str] = field(default_factory=dict)  # id -> reason
    set_aside: list[Quarantined] = field(default_factory=list)  # damaged shards / index moved to quarantine/
    planned: dict[str, Any] = field(default_factory=dict)  # the bytes the todo shards will write (sizing.py)


def plan_work(
    tokens: pl.DataFrame,
    folder: Path,
    shard_bytes: int,
    per_token: int,
    max_seq_len: int,
    expected: dict[str, str] | None = None,
) -> WorkPlan:
    """What is left to extract: samples not in any finished shard with the same content hash, sharded. A shard
    made by another extraction than `expected` describes (storage dtype, model, layers) is stale like a shard
    of re-tokenized samples: its samples are extracted again."""
    remove_stale_temporaries(folder)
    current = {
        sid: input_hash(ids)
        for sid, ids in zip(tokens["id"].to_list(), tokens["input_ids"].to_list(), strict=True)
    }
    done: set[str] = set()
    stale: list[str] = []
    for name, meta in finished_shards(folder).items():
        samples = meta["samples"]
        same = all(str(meta.get(k, "")) == str(v) for k, v in (expected or {}).items())
        if same and all(current.get(sid) == h for sid, _, h in samples):
            done.update(sid for sid, _, _ in samples)
        else:
            # re-tokenized or removed samples, or another extraction: the shard no longer describes what is
            # asked
            stale.append(name)
    lengths = {}
    skipped = {}
    for sid, n in zip(tokens["id"].to_list(), tokens["input_ids"].list.len().to_list(), strict=True):
        if sid in done:
            continue
        if n > max_seq_len:
            skipped[sid] = f"{n} tokens > hidden_states.max_seq_len {max_seq_len}"
            continue
        lengths[sid] = n
    return WorkPlan(plan_shards(lengths, shard_bytes, per_token), done, stale, skipped)


# -- extraction ----------------------------------------------------------------------------------------------
@dataclass
class ExtractionStats:
    samples: int = 0
    tokens: int = 0
    forwards: int = 0
    padded_tokens: int = 0  # always 0 with packing; kept to report it
    forward_s: float = 0.0
    bytes_written: int = 0
    shards: list[str] = field(default_factory=list)

    def merge(self, other: ExtractionStats) -> None:
        self.samples += other.samples
        self.tokens += other.tokens
        self.forwards += other.forwards
        self.padded_tokens += other.padded_tokens
        self.forward_s += other.forward_s
        self.bytes_written += other.bytes_written
        self.shards += other.shards


class ShardWriter:
    """Background thread: device-to-host copies of each forward's outputs, then the shard file, atomically."""

    def __init__(self, max_queued: int = 4) -> None:
        # max_queued 0: unbounded (the caller bounds its memory)
        self._jobs: queue.Queue = queue.Queue(maxsize=max_queued)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._error: BaseException | None = None
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if self._error is not None:
                continue  # after a failure nothing more is written: a shard must never miss rows
            try:
                job()
            except BaseException as e:  # surfaced on the next submit/close
                self._error = e

    def submit(self, job: Callable[[], None]) -> None:
        self.raise_error()
        self._jobs.put(job)

    def raise_error(self) -> None:
        """A job that failed surfaces here (and on every later submit and close)."""
        if self._error:
            raise self._error

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join()
        if self._error:
            raise self._error


def extract_shard(
    capture: HiddenStateCapture,
    plan: ShardPlan,
    samples: dict[str, Sample],
    folder: Path,
    row_tokens: int,
    store_dtype: str,
    metadata: dict[str, str],
    writer: ShardWriter | None = None,
) -> ExtractionStats:
    """Run the model over one shard's samples and write the shard (atomically) when all are captured."""
    import torch

    ordered = [samples[i] for i in plan.ids]
    rows = pack_rows([len(s.input_ids) for s in ordered], row_tokens)
    stats = ExtractionStats(samples=len(ordered), tokens=plan.n_tokens, forwards=len(rows))
    parts: dict[str, list[Any]] = {}
    own_writer = writer is None
    writer = writer or ShardWriter()

    def to_host(aux: list[Any], last: Any) -> None:
        for name, tensor in stored_states(aux, [last], store_dtype).items():
            parts.setdefault(name, []).append(tensor)

    for row in rows:
        t0 = time.perf_counter()
        aux, last = capture.forward_packed([ordered[i].input_ids for i in row])
        stats.forward_s += time.perf_counter() - t0
        writer.submit(functools.partial(to_host, aux, last))

    path = folder / plan.name

    def save() -> None:
        states = {k: torch.cat(v) for k, v in parts.items()}
        write_shard(
            path, ordered, states.pop("aux_hidden_states"), states.pop("last_hidden_state"), metadata, states
        )

    writer.submit(save)
    if own_writer:
        writer.close()
        stats.bytes_written = path.stat().st_size
    stats.shards.append(plan.name)
    return stats


def stored_states(aux: list[Any], last: list[Any], store_dtype: str) -> dict[str, Any]:
    """One forward's captured layers ([T, H] each, on the model's device) as the shard stores them, on the
    host: `aux_hidden_states` [T, n·H] and `last_hidden_state` [T, H] in the storage dtype; in FP8 with their
    `<name>_scales` [T, n] beside them, quantized on the device (a byte per value crosses to the host)."""
    import torch

    if is_fp8(store_dtype):
        (aux_q, aux_s), (last_q, last_s) = quantize_layers(aux), quantize_layers(last)
        return {
            "aux_hidden_states": aux_q,
            scales_name("aux_hidden_states"): aux_s,
            "last_hidden_state": last_q,
            scales_name("last_hidden_state"): last_s,
        }
    dtype = getattr(torch, store_dtype)
    return {
        name: xs[0].to("cpu", dtype=dtype)
        if len(xs) == 1
        else torch.cat([x.to("cpu", dtype=dtype) for x in xs], -1)
        for name, xs in (("aux_hidden_states", aux), ("last_hidden_state", last))
    }


def write_shard(
    path: Path,
    ordered: Sequence[Sample],
    aux: Any,
    last: Any,
    metadata: dict[str, str],
    scales: dict[str, Any] | None = None,
) -> None:
    """One shard file, atomically: the samples' ids and masks beside their states (rows in sample order), with
    the extraction's metadata and the sample list (id, length, content hash) that planning and the checks
    read. `scales`: the FP8 scales by tensor name (`aux_hidden_states_scales`, `last_hidden_state_scales`)."""
    import torch
    from safetensors.torch import save_file

    lengths = np.array([len(s.input_ids) for s in ordered], dtype=np.int64)
    cu = np.concatenate([[0], np.cumsum(lengths)])
    meta = dict(metadata)
    meta["format"] = FORMAT
    meta["samples"] = json.dumps([[s.id, len(s.input_ids), s.hash] for s in ordered])
    tensors = {
        "input_ids": torch.from_numpy(np.concatenate([s.input_ids for s in ordered]).astype(np.int32)),
        "loss_mask": torch.from_numpy(np.concatenate([s.loss_mask for s in ordered]).astype(np.int8)),
        "aux_hidden_states": aux.contiguous(),
        "last_hidden_state": last.contiguous(),
        "cu_seqlens": torch.from_numpy(cu),
        **{k: v.contiguous() for k, v in (scales or {}).items()},
    }
    rows = {k: int(t.shape[0]) for k, t in tensors.items() if k != "cu_seqlens"}
    if set(rows.values()) != {int(cu[-1])}:
        raise RuntimeError(f"shard {path.name} is inconsistent ({rows}, {int(cu[-1])} tokens); not written")
    atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata=meta))


def row_budget(device: str, attn_implementation: str | None, max_tokens_per_batch: int) -> int:
    if attn_implementation and attn_implementation.startswith("flash_attention"):
        return max_tokens_per_batch
    return min(max_tokens_per_batch, SDPA_ROW_TOKENS["cuda" if device.startswith("cuda") else "cpu"])


def load_samples(tokens_path: Path, ids: Iterable[str] | None = None) -> dict[str, Sample]:
    df = pl.read_parquet(tokens_path, columns=["id", "input_ids", "loss_mask"])
    if ids is not None:
        df = df.filter(pl.col("id").is_in(pl.Series(list(ids), dtype=pl.String).implode()))
    return {
        sid: Sample(sid, np.asarray(a, dtype=np.int32), np.asarray(m, dtype=np.int8))
        for sid, a, m in zip(
            df["id"].to_list(), df["input_ids"].to_list(), df["loss_mask"].to_list(), strict=True
        )
    }
