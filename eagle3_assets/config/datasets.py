"""The datasets (`datasets.<key>`), the tokens stage (`tokens`) and the checks' thresholds (`checks`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from .backends import SamplingConfig
from .base import Strict


class InstructionFields(Strict):
    """Field names of `format: instruction` rows."""

    instruction: str = Field(
        "instruction",
        description="The field holding the instruction; a row without it is quarantined.",
    )
    input: str = Field(
        "input",
        description="The field holding optional further input, appended to the instruction after a blank "
        "line.",
    )
    system: str | None = Field(
        None,
        description="The field holding a row's system prompt; null: rows have none (`system_prompt` can "
        "still add one).",
    )
    response: str | None = Field(
        None,
        description="The field holding the source's own answer, kept as the prompt's `source_answer` for the "
        "acceptance gate's comparison; null: the first of `response` (Magicoder) or `output` (Alpaca) that "
        "the row has.",
    )


class DatasetConfig(Strict):
    """One dataset: a partition of every asset."""

    source: str = Field(
        description="The dataset's prompt file: JSON Lines, JSON or Parquet (a relative path is relative to "
        "the config file's folder). An `id` field, where rows have one, is kept as the prompt's stable id.",
    )
    format: Literal["messages", "sharegpt", "instruction"] = Field(
        description="How rows are written: `messages` (OpenAI `{messages: [{role, content}]}`), `sharegpt` "
        "(`{conversations: [{from, value}]}`) or `instruction` (`{instruction, input}`, names set in "
        "`fields`). A trailing assistant turn is dropped: the target answers that turn afresh.",
    )
    budget_tokens: int = Field(
        10_000_000,
        ge=0,
        description="Hard budget of completion tokens (reasoning included) for this dataset, over all "
        "backends and runs together: dispatch stops before it would be exceeded, counting what is in flight. "
        "Raise it to buy more answers.",
    )
    budget_usd: float | None = Field(
        None,
        ge=0,
        description="Hard budget in US dollars for this dataset, over all backends and runs, from the cost "
        "each answer reports (OpenRouter's `usage.cost`); null: none. Where answers report no cost (SGLang, "
        "local, most vLLM servers) only `budget_tokens` applies.",
    )
    max_tokens: int = Field(
        4096,
        ge=1,
        description="Most completion tokens per request, reasoning included (OpenAI's `max_tokens`, SGLang's "
        "`max_new_tokens`); an answer cut there has finish reason `length`. Reasoning models need room "
        "(32768 for Kimi K2.5 thinking).",
    )
    turns: Literal["last", "all"] = Field(
        "last",
        description="`last`: the target answers the final user turn, earlier assistant turns stay the "
        "source's. `all`: the target answers every assistant turn in order, each request carrying its own "
        "earlier answers (a row per turn, id `<id>#t<k>`).",
    )
    fields: InstructionFields = Field(
        default_factory=InstructionFields,
        description="Field names of `format: instruction` rows (Alpaca, Magicoder and similar); ignored for "
        "the other formats.",
    )
    system_prompt: str | None = Field(
        None,
        description="A system prompt put first in every conversation of this dataset that has none (imported "
        "answers are matched with it too); null adds none. Changing it changes the prompts, and so their "
        "answers.",
    )
    tools: list[dict[str, Any]] | None = Field(
        None,
        description="Tool definitions (OpenAI's `{type: function, function: {name, description, "
        "parameters}}`, or bare `{name, description, parameters}`) offered with every row of this dataset "
        "that has no `tools` of its own; sent with each request and rendered by the target's template. A "
        "source call to a tool not offered quarantines its row.",
    )
    sampling: SamplingConfig | None = Field(
        None,
        description="Sampling for this dataset, replacing the top-level `sampling` as a whole (keys left out "
        "take their defaults, not the top-level values); null: the top-level `sampling`.",
    )
    description: str = Field(
        "",
        description="Free text for people reading the config (what the dataset holds); nothing reads it.",
    )


class TokensConfig(Strict):
    """The tokens stage: how each answer becomes `input_ids` and `loss_mask`."""

    train_all_assistant_turns: bool = Field(
        False,
        description="Set the loss mask on every assistant turn of a multi-turn row, the source's earlier "
        "turns included, not only on the answer the target generated. Rows of a `turns: all` dataset train "
        "every turn whatever this says.",
    )
    prefer_reference_ids: bool = Field(
        True,
        description="Where the backend returned the token ids it generated (SGLang, the embedded backend), "
        "store those rather than the ids rebuilt from the text; both are still compared for the "
        "`tokens_reference_match` check.",
    )
    batch_size: int = Field(
        512,
        ge=1,
        description="Conversations per tokenization chunk; two chunks per worker thread are in flight, so "
        "this bounds the stage's memory (512 stays under 1 GB with 10 KB answers).",
    )


class ChecksConfig(Strict):
    """Thresholds of the asset checks."""

    min_reference_match_rate: float = Field(
        0.99,
        ge=0,
        le=1,
        description="Blocking check `tokens_reference_match`: the share of rows whose rebuilt ids equal the "
        "ids the model produced (truncation tails excepted) must reach this; it fails when the rate's 95% "
        "interval lies below it. With a text-only backend there is nothing to compare and it passes, marked "
        "UNVERIFIED.",
    )
    max_token_error_share: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Blocking check `tokens_coverage`: the share of answered prompts whose conversation "
        "cannot be tokenized exactly (rows of `tokens_errors.parquet`) may be at most this.",
    )
    hidden_states_spot_samples: int = Field(
        3,
        ge=0,
        description="Samples the blocking check `hidden_states_spot_check` recomputes with an independent "
        "forward and compares with what is stored: the shortest, the median and the longest, so at most 3 "
        "count; 0 recomputes none.",
    )
    max_truncated_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Warning check `report_answer_quality`: the share of answers cut at `max_tokens` (finish "
        "reason `length`) may be at most this. Raise it where `max_tokens` is deliberately small.",
    )
    max_failure_share: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Blocking check `responses_failure_share`: the share of prompts whose last attempt "
        "failed may be at most this.",
    )
    max_degenerate_share: float = Field(
        0.2,
        ge=0,
        le=1,
        description="Warning check `report_answer_quality`: the share of degenerate answers (400 characters "
        "or more that compress to under 17% of their size: loops of the same phrase) may be at most this.",
    )
