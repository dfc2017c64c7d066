"""What every export layout is to the export that runs it: an `ExportFormat` writes the samples it is handed
and its side files into the export's work folder, and says how its consumer reads layers, lengths and
states."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..reader import StoredStates
from .target import TargetFacts


class ExportError(ValueError):
    """An export the consumer could not train from; the message says why and what to do."""


@dataclass
class Counts:
    """What went into an export, counted as the samples pass (the manifest and the log report them)."""

    samples: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    longest: int = 0  # as exported (after any cut)
    longest_source: int = 0
    truncated: int = 0
    dropped: int = 0  # left out: nothing a consumer trains on once cut (samples.plan_samples)


@dataclass(frozen=True)
class ExportSample:
    """One sample on its way into an export: its tensors named as the shards name them, cut to `max_len`."""

    index: int  # its place in export order: the layouts name their files by it
    id: str
    tensors: dict[str, Any]


@dataclass
class ExportJob:
    """One export's inputs and where it writes: `work`, a temporary folder swapped in as `out` when complete
    (the side files name `out`, where the consumer will find them)."""

    folder: Path  # the hidden_states folder
    work: Path
    out: Path
    source: StoredStates
    target: TargetFacts
    draft_vocab_size: int
    raw_fp8: bool  # the states as stored (FP8 with scales) rather than dequantized
    counts: Counts = field(default_factory=Counts)
    freq: Counter[int] = field(default_factory=Counter)  # trained token ids, counted as the samples pass


class ExportFormat(ABC):
    """A layout a training framework reads. Subclasses say how their consumer counts layers and cuts samples,
    and write the samples and the side files it needs."""

    name: ClassVar[str]
    min_samples: ClassVar[int] = 1
    needs: ClassVar[str] = "at least one"  # the refusal of an export with fewer samples than min_samples
    consumer_max_len: ClassVar[int]  # where the consumer cuts a sample by default (its own code, measured)
    reads_fp8: ClassVar[bool] = False  # FP8 states as stored; otherwise dequantized to bf16
    last_state_after_norm: ClassVar[bool] = True
    layer_convention: ClassVar[str]

    def layer_ids(self, aux_layers: list[int]) -> list[int]:
        """The aux layers (decoder outputs, 0-based) as this consumer reads them."""
        return list(aux_layers)

    @abstractmethod
    def write(self, samples: Iterator[ExportSample], job: ExportJob) -> dict[str, Any]:
        """Write every sample, then the side files, into `job.work`; returns the manifest's `files`."""

    @abstractmethod
    def train_command(self, job: ExportJob, limit: int) -> str:
        """The command that trains from this export, sequences up to `limit` tokens."""


def write_json(obj: Any, path: Path) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n")
