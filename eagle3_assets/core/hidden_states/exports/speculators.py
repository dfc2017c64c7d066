"""speculators: an HF Arrow dataset saved in torch format (`set_format("torch")`, as speculators' data
preparation saves it: its `ArrowDataset` compares the ids with `torch.equal`) with `input_ids`, `loss_mask`
(int64 lists), `seq_len`, `id`; `hidden_states/hs_{i}.safetensors` for row i holding `hidden_states` [S, 4, H]
(the three aux layers, then the last layer before the final norm) and `token_ids` [S] int64; `token_freq.pt`
({token id: count} over the trained tokens), from which `--draft-vocab-size` builds the draft vocabulary. From
FP8 shards the states stay FP8, with their scales (hs-connectors' layout)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..fp8 import scales_name
from ..layer_ids import output_hidden_states_ids
from .base import ExportFormat, ExportJob, ExportSample

ROWS_PER_BATCH = 1024  # rows of the Arrow stream written at a time


class Speculators(ExportFormat):
    name = "speculators"
    min_samples = 2  # it holds out the last n - int(0.9 * n) rows and refuses an empty training split
    needs = (
        "at least 2 samples (it holds out the last tenth for validation and refuses an empty training split)"
    )
    consumer_max_len = 8192
    reads_fp8 = True
    last_state_after_norm = False
    layer_convention = (
        "output_hidden_states indices (id j = output of decoder layer j - 1; 0 = embeddings), as vLLM"
    )

    def layer_ids(self, aux_layers: list[int]) -> list[int]:
        return output_hidden_states_ids(aux_layers)

    def write(self, samples: Iterator[ExportSample], job: ExportJob) -> dict[str, Any]:
        """The states per sample, then the Arrow dataset from a stream file (bounded memory at any size)."""
        # Outside the work folder: save_to_disk will not write over its own source.
        stream = job.work.with_name(job.work.name + ".rows.arrow")
        try:
            _write_rows(samples, job.work, stream)
            _save_dataset(stream, job.work)
        finally:
            stream.unlink(missing_ok=True)
        import torch

        # speculators' own data preparation writes {token id: count} over the trained tokens.
        torch.save({int(k): int(v) for k, v in sorted(job.freq.items())}, job.work / "token_freq.pt")
        return {
            "dataset": "datasets.load_from_disk (torch format)",
            "hidden_states": "hidden_states/hs_{i}.safetensors",
            "token_freq": "token_freq.pt",
            "draft_vocab_size": self.draft_vocab_size(job),
        }

    def draft_vocab_size(self, job: ExportJob) -> int:
        return min(job.draft_vocab_size, job.target.vocab_size)

    def train_command(self, job: ExportJob, limit: int) -> str:
        ids = self.layer_ids(job.source.aux_layers)
        command = (
            f"speculators train --verifier-name-or-path {job.target.path} --data-path {job.out} "
            f"--target-layer-ids {' '.join(map(str, ids))} --draft-vocab-size {self.draft_vocab_size(job)} "
            f"--total-seq-len {limit} --on-missing raise --save-path ./checkpoints"
        )
        # FP8 files are read through hs-connectors' FP8Transfer.
        return command + " --hidden-states-backend fp8" if job.raw_fp8 else command


def _write_rows(samples: Iterator[ExportSample], work: Path, stream: Path) -> None:
    """Each sample's states file and its row in the Arrow stream (one sample's states in memory at once)."""
    import pyarrow as pa
    from safetensors.torch import save_file

    hs_dir = work / "hidden_states"
    hs_dir.mkdir()
    schema = pa.schema(
        [
            ("input_ids", pa.list_(pa.int64())),
            ("loss_mask", pa.list_(pa.int64())),
            ("seq_len", pa.int64()),
            ("id", pa.string()),
        ]
    )
    batch: dict[str, list] = {name: [] for name in schema.names}
    with pa.OSFile(str(stream), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:

        def flush() -> None:
            writer.write_batch(pa.record_batch([batch[k] for k in schema.names], schema=schema))
            for v in batch.values():
                v.clear()

        for s in samples:
            save_file(speculators_states(s.tensors), str(hs_dir / f"hs_{s.index}.safetensors"))
            ids = s.tensors["input_ids"]
            batch["input_ids"].append(ids.numpy())
            batch["loss_mask"].append(s.tensors["loss_mask"].numpy())
            batch["seq_len"].append(int(ids.shape[0]))
            batch["id"].append(s.id)
            if len(batch["id"]) >= ROWS_PER_BATCH:
                flush()
        if batch["id"]:
            flush()


def _save_dataset(stream: Path, work: Path) -> None:
    import datasets

    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_file(str(stream), in_memory=False)
    ds.set_format(type="torch")  # what speculators' ArrowDataset expects (torch.equal on the ids)
    ds.save_to_disk(str(work))
    del ds
    for cache in work.glob("cache-*.arrow"):
        cache.unlink()


def speculators_states(s: dict[str, Any]) -> dict[str, Any]:
    """One `hs_{i}.safetensors`: `hidden_states` [S, 4, H] (3 aux layers, then the last) and `token_ids`; from
    FP8 shards the float8 values as stored and `hidden_states_scales` [S, 4, 1] (hs-connectors' layout)."""
    import torch

    aux, last = s["aux_hidden_states"], s["last_hidden_state"]
    t, h = last.shape
    out = {
        "hidden_states": torch.cat([aux.view(t, -1, h), last.view(t, 1, h)], dim=1).contiguous(),
        "token_ids": s["input_ids"],
    }
    if scales_name("aux_hidden_states") in s:
        scales = [s[scales_name("aux_hidden_states")], s[scales_name("last_hidden_state")]]
        out["hidden_states_scales"] = torch.cat(scales, dim=1).float()[..., None].contiguous()
    return out
