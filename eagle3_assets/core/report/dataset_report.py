"""The validation report of one dataset (report.json): its fields in the file's order, as a training job's
operator reads them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from .tool_figures import ToolCallFigures

# Present in report.json only where tokens.parquet has rows, and only where some rows have reference ids.
TOKEN_ROW_KEYS = ("loss_tokens", "ids_source")
REFERENCE_KEYS = (
    "reference_match_rate_excluding_truncation_tails",
    "reference_match_rate_finished",
    "n_reference_finished",
)


@dataclass(frozen=True)
class HistogramBin:
    start: float  # "from" in report.json
    end: float  # "to"
    count: int

    def to_json(self) -> dict[str, Any]:
        return {"from": self.start, "to": self.end, "count": self.count}


@dataclass
class TurnCounts:
    """`turns: all`: how many turns the conversations have, how many are answered, in how many
    conversations."""

    total: int
    answered: int
    conversations_answered: int
    conversations_complete: int
    # Answered up to a turn the template refuses: the rest is recorded (failures, kind template_rest) and not
    # counted as failed requests by the failure-share check.
    conversations_cut_by_template: int = 0


@dataclass(frozen=True)
class DuplicateIds:
    responses_files: int
    tokens: int


@dataclass(frozen=True)
class DamagedFile:
    """A file a stage found damaged and set aside (quarantine/<stage>/): where it was and why."""

    path: str
    stage: str
    reason: str
    rows: int | None
    moved_to: str


@dataclass(frozen=True)
class OutputPaths:
    dir: str
    tokens: str
    responses: str


@dataclass
class ValidationReport:
    dataset: str
    generated_at: str
    n_prompts: int
    n_quarantined: int
    n_responses: int
    n_failures: int
    failure_kinds: dict[str, int]
    coverage: float  # turns: all: answered turns over the conversations' turns (a response row is a turn)
    turns: TurnCounts | None
    budget_tokens: int
    budget_usd: float | None
    completion_tokens: int
    prompt_tokens: int
    budget_used_share: float | None
    cost_usd: float | None
    backends: dict[str, int]
    models: dict[str, int]
    providers: dict[str, int]
    sources: dict[str, int]
    finish_reasons: dict[str, int]
    truncated_share: float
    empty_answers: int
    degenerate_answers: int
    degenerate_share: float
    reasoning_share: float
    responses_with_output_ids: int
    duplicate_ids: DuplicateIds
    n_tokens_rows: int
    n_tokens_errors: int
    reference_match_rate: float | None
    n_reference: int
    mismatch_kinds: dict[str, int]
    token_lengths: dict[str, float]  # percentiles by name
    token_length_histogram: list[HistogramBin]
    completion_token_lengths: dict[str, float]
    damaged_files: list[DamagedFile]
    outputs: OutputPaths
    loss_tokens: int | None = None
    reference_match_rate_excluding_truncation_tails: float | None = None
    reference_match_rate_finished: float | None = None
    n_reference_finished: int | None = None
    ids_source: dict[str, int] = field(default_factory=dict)
    # completion_tokens is what the budget charged: per answer the larger of the provider's usage and this
    # platform's own count of what arrived. Both are kept, so a provider's lie shows here.
    completion_tokens_reported: int = 0
    completion_tokens_counted: int = 0
    answers_cut_at_max_tokens: int = 0  # the provider sent more than max_tokens: kept up to the limit
    answers_by_model_and_provider: dict[str, int] = field(default_factory=dict)
    quantizations: dict[str, int] = field(default_factory=dict)
    # Answers kept in set_aside/ and never trained, by reason (edited or removed prompts, changed settings,
    # another model, an earlier target), and the completion tokens they were charged.
    answers_set_aside: dict[str, int] = field(default_factory=dict)
    completion_tokens_set_aside: int = 0
    target: str | None = None  # the target the answers belong to (target.json)
    # An agentic dataset's calls (`tool_figures`); absent from report.json where no answer calls a tool.
    tool_calls: ToolCallFigures | None = None

    def to_json(self) -> dict[str, Any]:
        """report.json, leaving out the keys of figures that were not measured (TOKEN_ROW_KEYS,
        REFERENCE_KEYS)."""
        out = asdict(self)
        out["token_length_histogram"] = [b.to_json() for b in self.token_length_histogram]
        absent = (
            (TOKEN_ROW_KEYS if not self.n_tokens_rows else ())
            + (REFERENCE_KEYS if not self.n_reference else ())
            + (("tool_calls",) if self.tool_calls is None else ())
        )
        return {k: v for k, v in out.items() if k not in absent}
