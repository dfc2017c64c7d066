"""How a draft is measured, whichever engine measures it: the figures of one part (acceptance length,
conditional rates per position, the prompts, the engine's own counters), and the two things the gate asks of
an engine.

- `DraftMeasurer`: greedy speculative decoding of prompt sets with a draft, and greedy decoding without one.
  The in-process engine (`decoding.InProcessMeasurer`) runs the target here with this project's loop; the
  served one (`resources.vllm.acceptance`) starts vLLM with the draft as EAGLE-3 and reads vLLM's counters.
- `FeatureSource`: the target's aux states over token ids (the source-answers arm trains on them).

The draft trains from the stored states with only two pieces of the target: its config (the draft's shape) and
its embedding, read from the checkpoint's safetensors by name (`DraftTarget.load`): never the whole model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class SpecCounters:
    """An engine's speculative-decoding counters (vLLM's `spec_decode_*`), or their difference over a part."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()

    def minus(self, before: SpecCounters) -> SpecCounters:
        k = max(len(self.accepted_per_position), len(before.accepted_per_position))
        now = list(self.accepted_per_position) + [0] * (k - len(self.accepted_per_position))
        was = list(before.accepted_per_position) + [0] * (k - len(before.accepted_per_position))
        return SpecCounters(
            self.num_drafts - before.num_drafts,
            self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens,
            tuple(a - b for a, b in zip(now, was, strict=True)),
        )

    def as_report(self) -> dict[str, Any]:
        out = asdict(self)
        out["accepted_per_position"] = list(self.accepted_per_position)
        return out


@dataclass
class PartMeasure:
    """Acceptance of one draft on a set of prompts."""

    acceptance_length: float
    per_position: list[float]
    n_prompts: int
    n_steps: int
    new_tokens: int
    prompt_ids: list[str] = field(default_factory=list)
    counters: dict[str, Any] | None = (
        None  # the engine's own counts over this part, where an engine measured it
    )

    @classmethod
    def from_rounds(
        cls, rounds: list[int], k: int, prompt_ids: Sequence[str], new_tokens: int
    ) -> PartMeasure:
        """From the accepted drafts of each verifying forward (this project's loop)."""
        per = []
        for i in range(1, k + 1):
            tried = sum(1 for a in rounds if a >= i - 1)
            per.append(sum(1 for a in rounds if a >= i) / tried if tried else 0.0)
        mean = float(np.mean([a + 1 for a in rounds])) if rounds else 0.0
        return cls(
            round(mean, 4),
            [round(p, 4) for p in per],
            len(prompt_ids),
            len(rounds),
            new_tokens,
            list(prompt_ids),
        )

    @classmethod
    def from_counters(
        cls, c: SpecCounters, k: int, prompt_ids: Sequence[str], new_tokens: int
    ) -> PartMeasure:
        """From an engine's counters: acceptance length = 1 + accepted / drafts; the rate at position i is
        conditional (drafts accepted through i, over those accepted through i - 1), as `from_rounds`
        counts."""
        per_pos = list(c.accepted_per_position) + [0] * (k - len(c.accepted_per_position))
        per, tried = [], c.num_drafts
        for accepted in per_pos[:k]:
            per.append(round(accepted / tried, 4) if tried else 0.0)
            tried = accepted
        length = round(1 + c.num_accepted_tokens / c.num_drafts, 4) if c.num_drafts else 0.0
        return cls(length, per, len(prompt_ids), c.num_drafts, new_tokens, list(prompt_ids), c.as_report())


@dataclass(frozen=True)
class PromptSet:
    """The prompts of one part: sample ids and their rendered generation prompts (token ids), in order."""

    ids: list[str]
    prompts: list[list[int]]

    def head(self, n: int) -> PromptSet:
        return PromptSet(self.ids[:n], self.prompts[:n])


@dataclass
class Measured:
    part: PartMeasure
    outputs: list[list[int]]  # the tokens generated from each prompt


class DraftMeasurer(Protocol):
    engine: str
    device: str  # where the target runs, as the report says it

    def measure(self, draft: Any, folder: Path, parts: Mapping[str, PromptSet]) -> dict[str, Measured]:
        """Greedy speculative decoding of each part with the draft (the module, saved in `folder`)."""
        ...

    def greedy(self, prompts: PromptSet) -> list[list[int]]:
        """Greedy decoding by the target alone (no draft)."""
        ...


class FeatureSource(Protocol):
    def aux_states(self, samples: Sequence[np.ndarray]) -> list[Any]:
        """The target's aux states [T, n_aux x H] (float32, CPU) over each sample's ids."""
        ...


@dataclass
class DraftTarget:
    """What the draft needs of the target: its config (the draft's shape, the vocabulary) and its
    embedding."""

    config: Any
    embedding: Any  # [vocab, H] float32

    @property
    def vocab_size(self) -> int:
        return int(self.config.get_text_config().vocab_size)

    @classmethod
    def load(cls, model_ref: str, revision: str | None, trust_remote_code: bool) -> DraftTarget:
        """The config and the embedding, read from the checkpoint by tensor name (never the whole model)."""
        from transformers import AutoConfig

        from ..target_model.pieces import CheckpointPieces

        pieces = CheckpointPieces.find(model_ref, revision)
        config = AutoConfig.from_pretrained(str(pieces.root), trust_remote_code=trust_remote_code)
        return cls(config, pieces.embedding().float())


@dataclass
class GreedyDifference:
    first_difference: int  # the first position where the two outputs differ
    drafted_tokens: int
    plain_tokens: int


@dataclass
class GreedyCheck:
    """Greedy output with the draft against greedy output without it, over a sample of prompts."""

    prompts: int
    equal: int
    differences: dict[str, GreedyDifference]  # by sample id, the prompts whose outputs differ


def greedy_differences(
    prompts: PromptSet, drafted: Sequence[Sequence[int]], plain: Sequence[Sequence[int]]
) -> GreedyCheck:
    """Where greedy output with the draft differs from greedy output without it (speculative decoding must not
    change a greedy answer): per differing prompt, the first position that differs."""
    bad = {}
    for sid, a, b in zip(prompts.ids, drafted, plain, strict=True):
        if list(a) != list(b):
            first = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
            )
            bad[sid] = GreedyDifference(first, len(a), len(b))
    return GreedyCheck(len(prompts.ids), len(prompts.ids) - len(bad), bad)
