"""The acceptance gate (`acceptance`): the draft trained on a partition and measured against the target."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Strict
from .vllm_server import VllmServerConfig


class AcceptanceVllmConfig(VllmServerConfig):
    """The vLLM server the acceptance step starts itself: the target with the trained draft as EAGLE-3 (and,
    for the source-answers arm, the target extracting the source answers' states), on the step's devices."""

    max_model_len: int | None = Field(
        None,
        ge=16,
        description="The server's `--max-model-len`; null: the longest measured prompt plus "
        "`max_new_tokens`, `draft_tokens` and 8.",
    )
    request_timeout_s: float = Field(
        900.0,
        gt=0,
        description="Seconds one measured request may take.",
    )
    max_concurrency: int = Field(
        8,
        ge=1,
        description="Measured prompts in flight at once.",
    )
    greedy_check_prompts: int = Field(
        4,
        ge=0,
        description="Heldout prompts also decoded greedily by the target alone and compared token for token "
        "with the drafted outputs: speculative decoding must not change a greedy answer. Both engines read "
        "it.",
    )


class AcceptanceConfig(Strict):
    """The acceptance gate (asset `acceptance`): a small EAGLE-3 draft trained on the partition, measured
    against the target with greedy speculative decoding."""

    draft_tokens: int = Field(
        4,
        ge=1,
        le=16,
        description="k: draft tokens proposed per target forward, in measurement (and by default the "
        "training-time-test depth).",
    )
    train_prompts: int = Field(
        24,
        ge=1,
        description="Samples the draft trains on, taken after the heldout ones in an order fixed by a hash "
        "of their ids (the same on every run and machine).",
    )
    heldout_prompts: int = Field(
        8,
        ge=1,
        description="Samples kept out of training and measured (at most a quarter of the partition); as many "
        "training prompts are measured beside them.",
    )
    train_steps: int = Field(
        150,
        ge=1,
        description="Optimizer steps of the draft's training, the gate's fixed training budget (AdamW, a "
        "short warm-up, then cosine decay).",
    )
    ttt_steps: int | None = Field(
        None,
        ge=1,
        description="Training-time-test depth: how many steps the draft is trained to draft in a row on its "
        "own outputs; null: `draft_tokens`.",
    )
    learning_rate: float = Field(
        3e-3,
        gt=0,
        description="Peak learning rate of the draft's training.",
    )
    batch_tokens: int = Field(
        512,
        ge=16,
        description="Tokens per optimizer step (samples packed up to this many).",
    )
    draft_vocab_size: int = Field(
        4096,
        ge=16,
        description="Size of the draft's vocabulary: the target tokens seen most often in the training "
        "answers (at most the target's vocabulary).",
    )
    max_new_tokens: int = Field(
        64,
        ge=2,
        description="Tokens generated per measured prompt; the draft trains on the same opening window of "
        "each answer.",
    )
    min_train_share: float = Field(
        0.8,
        gt=0,
        le=1,
        description="The gate's threshold: the acceptance length on training prompts must reach this share "
        "of its maximum, k + 1 (the heldout prompts must also beat an untrained draft).",
    )
    compare_source_answers: bool = Field(
        True,
        description="Also train the same draft on the dataset's own answers, where at least half the "
        "training prompts have one, and measure it on the heldout prompts: the difference is what "
        "regenerating the answers buys.",
    )
    device: str = Field(
        "auto",
        description="Where the `transformers` engine runs its decoding loop: `auto`, `cpu`, `cuda` or "
        "`cuda:N`. The target itself is loaded on `hidden_states.device`, so keep the two alike; unused with "
        "`engine: vllm`.",
    )
    seed: int = Field(
        0,
        description="Seed of the draft's initialisation and of the training order, so a partition's gate is "
        "reproducible.",
    )
    engine: Literal["transformers", "vllm"] = Field(
        "transformers",
        description="`transformers`: this process measures the draft with its own speculative decoding loop "
        "(the target must fit the step); `vllm`: the step starts vLLM serving the target with the draft as "
        "EAGLE-3 and reads the engine's own counters (the target never enters this process).",
    )
    vllm: AcceptanceVllmConfig = Field(
        default_factory=AcceptanceVllmConfig,
        description="The vLLM server the step starts when `engine` is `vllm`.",
    )
