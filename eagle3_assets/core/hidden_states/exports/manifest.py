"""What an export says about itself: `eagle3_config.json` (the layer ids in the consumer's convention) and
`manifest.json` (the target, the layers, dtype, counts, the side files and the command that trains from it),
so that a consumer can refuse data for another target."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..reader import StoredStates
from .base import ExportFormat, ExportJob

MANIFEST = "manifest.json"
LAYER_CONFIG = "eagle3_config.json"


@dataclass(frozen=True)
class LayerConfig:
    """`eagle3_config.json`: the aux layer ids in the key and the convention a format reads them in."""

    format: str
    eagle_aux_hidden_state_layer_ids: list[int]
    layer_convention: str
    num_hidden_layers: int
    last_hidden_state: str
    model: str | None
    revision: str | None

    @classmethod
    def of(cls, fmt: ExportFormat, source: StoredStates) -> LayerConfig:
        last = "after the final norm" if fmt.last_state_after_norm else "before the final norm"
        return cls(
            format=fmt.name,
            eagle_aux_hidden_state_layer_ids=fmt.layer_ids(source.aux_layers),
            layer_convention=fmt.layer_convention,
            num_hidden_layers=source.num_layers,
            last_hidden_state=f"output of decoder layer {source.num_layers - 1}, {last}",
            model=source.model,
            revision=source.revision,
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def manifest(
    fmt: ExportFormat,
    job: ExportJob,
    layers: LayerConfig,
    max_len: int | None,
    files: dict[str, Any],
    states: dict[str, Any],
) -> dict[str, Any]:
    """`manifest.json`; `states` are the dtype entries (`samples.StatesAs.manifest`)."""
    from importlib.metadata import version

    counts, target, source = job.counts, job.target, job.source
    limit = max(fmt.consumer_max_len, counts.longest)
    out = {
        "format": fmt.name,
        "producer": f"eagle3-assets {version('eagle3-assets')}",
        "target": {
            "model": source.model,
            "revision": source.revision,
            "tokenizer": source.tokenizer,
            "num_hidden_layers": source.num_layers,
            "hidden_size": int(target.config.hidden_size),
            "vocab_size": target.vocab_size,
        },
        "aux_layer_ids": layers.eagle_aux_hidden_state_layer_ids,
        "layer_convention": layers.layer_convention,
        "last_hidden_state": layers.last_hidden_state,
        "dtype": source.dtype,
        "samples": counts.samples,
        "tokens": counts.tokens,
        "trained_tokens": counts.loss_tokens,
        "longest_sample": counts.longest,
        "longest_source_sample": counts.longest_source,
        "max_len": max_len,
        "truncated_samples": counts.truncated,
        "dropped_samples": counts.dropped,  # no trained token left (samples.plan_samples); not in `samples`
        "files": files,
        "train_command": fmt.train_command(job, limit),
    }
    return out | states
