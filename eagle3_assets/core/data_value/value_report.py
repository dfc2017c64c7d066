"""`<root>/data_value/report.json` and report.md: one row per draft measured on the suite, each beside what
its data cost. The row keys named in the design page's contract are kept exactly; the rest add context."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from ...config.data_value import FLOOR_DRAFT
from ..storage.files import write_json, write_text

FLOOR = FLOOR_DRAFT  # the row of the untrained draft: the floor every price is measured from


class SuiteCost(BaseModel):
    """What the target's answers to the suite cost: every stored suite answer (whichever run bought it), and
    what this run sent (0 where every answer stood: never paid twice)."""

    backend: str  # the backend of this run ("" where the report was computed without answering)
    answers: int
    cost_usd: float
    completion_tokens: int
    priced_answers: int
    sent_this_run: int
    seconds: float
    greedy: bool  # sampling was greedy: each draft's output is compared with the target's answer


class SuiteSummary(BaseModel):
    n_prompts: int
    source: str  # the file, or `dataset:<key> (<file>)`
    prompt_ids: list[str]
    held_out_dataset: str | None = None
    n_source_prompts: int = 0
    looping_prompt_ids: list[str] = []  # suite prompts whose decoded output loops (see flags)
    quarantined: dict[str, str] = {}  # suite rows left out before training (too long, malformed): reason
    answers: SuiteCost | None = None  # None: measured against the engine's own greedy output (no answers)


class DraftRow(BaseModel):
    draft: str  # a partition key, `all`, `all-but-<key>`, or `untrained` (the floor)
    datasets: list[str]  # the partitions it trained on
    acceptance_length: float
    per_position: list[float]
    cost_usd: float
    completion_tokens: int
    gpu_seconds: float  # extraction of its datasets' states + this draft's training
    usd_per_0_1_acceptance: float | None
    flags: list[str]
    gain_over_floor: float
    n_train_samples: int
    answers_bought: int
    extraction_seconds: float
    training_seconds: float
    measure_seconds: float
    final_loss: float | None = None
    acceptance_length_without_loops: float | None = None  # on the suite prompts that do not loop
    # Suite ids whose greedy output is not the target's stored answer; None: not compared (sampled suite).
    differs_from_target: list[str] | None = None


class DataValueReport(BaseModel):
    suite: SuiteSummary
    rows: list[DraftRow]
    floor_acceptance_length: float
    engine: str
    draft_tokens: int
    max_new_tokens: int
    train_steps: int
    cost_basis: str  # what cost_usd sums
    seconds: dict[str, float]
    device: str = ""

    def row(self, draft: str) -> DraftRow:
        return next(r for r in self.rows if r.draft == draft)

    def write(self, folder: Path) -> None:
        write_json(self.model_dump(), folder / "report.json")
        write_text(markdown(self), folder / "report.md")


def _cell(v: float | None, digits: int) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def table(r: DataValueReport) -> str:
    """The rows as a markdown table, best acceptance first, the floor last."""
    head = (
        "| draft | acceptance length | gain over floor | per position | cost USD | completion tokens "
        "| GPU s | USD per 0.1 | flags |\n| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | --- |\n"
    )
    rows = sorted(r.rows, key=lambda x: (x.draft == FLOOR, -x.acceptance_length))
    return head + "\n".join(
        f"| {x.draft} | {x.acceptance_length:.3f} | {x.gain_over_floor:+.3f} | "
        f"{', '.join(f'{p:.2f}' for p in x.per_position)} | {x.cost_usd:.4f} | {x.completion_tokens} | "
        f"{x.gpu_seconds:.1f} | {_cell(x.usd_per_0_1_acceptance, 4)} | {'; '.join(x.flags) or ''} |"
        for x in rows
    )


def markdown(r: DataValueReport) -> str:
    s = r.suite
    return (
        "# What the data buys\n\n"
        f"Suite: {s.n_prompts} prompts from {s.source}; engine `{r.engine}`, k = {r.draft_tokens}, "
        f"{r.max_new_tokens} new tokens per prompt, {r.train_steps} training steps per draft. Untrained "
        f"floor: {r.floor_acceptance_length:.3f} tokens per target forward.\n\n"
        f"{table(r)}\n\n"
        f"cost_usd: {r.cost_basis}. gpu_seconds: extraction of the draft's datasets plus its own training. "
        "USD per 0.1 = cost_usd / ((acceptance length - floor) / 0.1), empty where nothing was paid or "
        "nothing gained.\n"
    )
