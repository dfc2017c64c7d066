"""The three export layouts (speculators, SpecForge, Model-Optimizer), one sample at a time, and their side files.
What each layout holds and why: export.py's docstring."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..storage.layout import FINAL_NORM
from .export_target import TargetFacts
from .fp8 import scales_name
from .shards import finished_shards

SPECFORGE_GROUP = 2000
# Where each consumer cuts a sample by default (its own code, measured): longer samples train on their head only.
CONSUMER_MAX_LEN = {"speculators": 8192, "specforge": 2048, "modelopt": 2048}


@dataclass
class Counts:
    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    longest: int = 0  # as exported (after any cut)
    longest_source: int = 0
    truncated: int = 0
    dropped: int = 0  # left out: nothing a consumer trains on once cut (see _plan)


def write_json(obj: Any, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")


def final_norm(folder: Path) -> Callable[[Any], Any]:
    from safetensors import safe_open

    path = folder / FINAL_NORM
    if not path.exists():
        raise FileNotFoundError(
            f"{path} is missing; re-materialise hidden_states (it is written with the shards)"
        )
    with safe_open(str(path), framework="pt") as f:
        weight = f.get_tensor("weight")
        meta = f.metadata() or {}
    eps = float(meta.get("eps", 1e-6))
    if "rms" not in meta.get("kind", "RMSNorm").lower():
        raise ValueError(
            f"final norm {meta.get('kind')} is not an RMSNorm; post-norm export is not supported"
        )

    def rms_norm(x: Any) -> Any:
        import torch

        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return (weight * h).to(x.dtype)

    return rms_norm


# -- the three layouts ---------------------------------------------------------------------------------------
SideWriter = Callable[[Path, Path, TargetFacts, Counter, Counts, int], dict[str, Any]]
SPECFORGE_RUN = "specforge_train.yaml"


def speculators_layout(samples: Iterator, folder: Path, work: Path) -> SideWriter:
    """The states per sample, then the Arrow dataset from a stream file (bounded memory at any size)."""
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
    stream = work.with_name(
        work.name + ".rows.arrow"
    )  # outside: save_to_disk will not write over its own source
    batch: dict[str, list] = {name: [] for name in schema.names}
    with pa.OSFile(str(stream), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:

        def flush() -> None:
            writer.write_batch(pa.record_batch([batch[k] for k in schema.names], schema=schema))
            for v in batch.values():
                v.clear()

        for i, sid, s in samples:  # one sample's states in memory at a time
            save_file(speculators_states(s), str(hs_dir / f"hs_{i}.safetensors"))
            t = int(s["input_ids"].shape[0])
            batch["input_ids"].append(s["input_ids"].numpy())
            batch["loss_mask"].append(s["loss_mask"].numpy())
            batch["seq_len"].append(int(t))
            batch["id"].append(sid)
            if len(batch["id"]) >= 1024:
                flush()
        if batch["id"]:
            flush()

    def side(work: Path, out: Path, target: TargetFacts, freq: Counter, counts: Counts, vocab: int) -> dict:
        import datasets
        import torch

        datasets.disable_progress_bars()
        ds = datasets.Dataset.from_file(str(stream), in_memory=False)
        ds.set_format(type="torch")  # what speculators' ArrowDataset expects (torch.equal on the ids)
        ds.save_to_disk(str(work))
        del ds
        stream.unlink()
        for cache in work.glob("cache-*.arrow"):
            cache.unlink()
        # speculators' own data preparation writes {token id: count} over the trained tokens.
        torch.save({int(k): int(v) for k, v in sorted(freq.items())}, work / "token_freq.pt")
        return {
            "dataset": "datasets.load_from_disk (torch format)",
            "hidden_states": "hidden_states/hs_{i}.safetensors",
            "token_freq": "token_freq.pt",
            "draft_vocab_size": min(vocab, target.vocab_size),
        }

    return side


def speculators_states(s: dict[str, Any]) -> dict[str, Any]:
    """One `hs_{i}.safetensors`: `hidden_states` [S, 4, H] (3 aux layers, then the last) and `token_ids`; from FP8
    shards the float8 values as stored and `hidden_states_scales` [S, 4, 1] (hs-connectors' FP8 layout)."""
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


def specforge_layout(samples: Iterator, folder: Path, work: Path) -> SideWriter:
    import torch

    norm = final_norm(folder)
    for i, _sid, s in samples:
        group = i // SPECFORGE_GROUP * SPECFORGE_GROUP
        path = work / f"rows_{group}-{group + SPECFORGE_GROUP}" / f"data_{i}.ckpt"
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(
            {
                "input_ids": s["input_ids"],
                "loss_mask": s["loss_mask"],
                "hidden_state": norm(s["last_hidden_state"]).unsqueeze(0).contiguous(),
                "aux_hidden_state": s["aux_hidden_states"].unsqueeze(0).contiguous(),
            },
            path,
        )

    def side(work: Path, out: Path, target: TargetFacts, freq: Counter, counts: Counts, vocab: int) -> dict:
        return specforge_side_files(work, out, folder, target, freq, counts, vocab)

    return side


def specforge_side_files(
    work: Path, out: Path, folder: Path, target: TargetFacts, freq: Counter, counts: Counts, vocab: int
) -> dict[str, Any]:
    """The vocabulary maps where SpecForge's preparation writes them, a draft config of the same vocabulary for
    this target, and a run config that trains from this folder."""
    import torch
    import yaml

    from .draft_format import DraftShape, build_draft_vocab, draft_config, vocab_mapping

    shape = DraftShape.from_target(target.config, vocab)
    chosen = build_draft_vocab(freq, shape.vocab_size, shape.draft_vocab_size, fill=True)
    d2t, t2d = vocab_mapping(chosen, shape.vocab_size)
    (work / "vocab_mapping").mkdir()
    torch.save({"d2t": d2t, "t2d": t2d}, work / "vocab_mapping" / "vocab_mapping.pt")
    aux = json.loads(next(iter(finished_shards(folder).values()))["aux_layers"])
    write_json(draft_config(shape, aux, "bfloat16"), work / "draft_config.json")
    run = {
        "model": {
            "target_model_path": target.path,
            "draft_model_config": str(out / "draft_config.json"),
            "vocab_mapping_path": str(out / "vocab_mapping" / "vocab_mapping.pt"),
            "lm_head_key": target.lm_head_key,
            "embedding_key": target.embedding_key,
            "aux_hidden_state_layer_ids": aux,
            "torch_dtype": "bfloat16",
        },
        "data": {
            "hidden_states_path": str(out),
            "max_length": max(CONSUMER_MAX_LEN["specforge"], counts.longest),
        },
        "training": {
            "strategy": "eagle3",
            "num_epochs": 10,
            "batch_size": 1,
            "learning_rate": 1e-4,
            "max_grad_norm": 0.5,
            "ttt_length": 7,
            "seed": 0,
        },
        "run_id": f"eagle3-{out.name}",
        "output_dir": str(out.parent / f"{out.name}-specforge-run"),
    }
    (work / SPECFORGE_RUN).write_text(
        "# SpecForge 0.2.0 offline EAGLE-3 training from this export: specforge train --config <this file>\n"
        "# (SpecForge's target head reads the target through a *.safetensors.index.json in its folder)\n"
        + yaml.safe_dump(run, sort_keys=False)
    )
    return {
        "vocab_mapping": "vocab_mapping/vocab_mapping.pt",
        "draft_config": "draft_config.json",
        "run_config": SPECFORGE_RUN,
        "draft_vocab_size": shape.draft_vocab_size,
        "target_weight_index": target.weight_index,
    }


def modelopt_layout(samples: Iterator, folder: Path, work: Path) -> None:
    norm = final_norm(folder)
    import torch

    for i, sid, s in samples:
        # The index keeps names unique where ids differ only in characters a file name cannot hold.
        safe = f"{i:07d}-" + "".join(c if c.isalnum() or c in "-_." else "_" for c in sid)[:100]
        torch.save(
            {
                "input_ids": s["input_ids"],
                "hidden_states": norm(s["last_hidden_state"]).contiguous(),
                "aux_hidden_states": s["aux_hidden_states"].contiguous(),
                "loss_mask": s["loss_mask"],
                "conversation_id": sid,
            },
            work / f"{safe}.pt",
        )
    return None
