"""The gate's report (acceptance/report.json, which the asset, its check and the benches read back) and its
verdict, computed once, from the figures the report holds."""

from __future__ import annotations

from pydantic import BaseModel

from ...config import AcceptanceConfig
from ..storage.files import write_json
from ..storage.layout import DatasetLayout
from .measure import GreedyCheck, PartMeasure
from .simulated import SimulatedAcceptance


class SourceAnswersSkipped(BaseModel):
    skipped: str  # why the source-answers arm did not run


class SourceAnswersMeasured(BaseModel):
    """The same draft trained on the dataset's own answers, measured on the same heldout prompts."""

    n_samples: int
    heldout: PartMeasure
    train_final_loss: float


class TrainingSummary(BaseModel):
    optimizer_steps: int
    ttt_steps: int
    samples: int
    tokens_seen: int
    first_loss: float
    final_loss: float
    final_step_accuracy: list[float]
    draft_vocab_size: int
    # implied by the last training batch's step accuracy (optimistic: see core.acceptance.simulated)
    simulated_acceptance_length: float | None = None


class BoundaryCheck(BaseModel):
    checked: int
    bad: int
    examples: dict[str, str]  # a few of the bad samples, by id: why their answer span is off


class SglangReading(BaseModel):
    """The draft's layers as SGLang reads them (decoder-layer outputs), in a config of their own."""

    config: str
    eagle_aux_hidden_state_layer_ids: list[int]
    how: str


class DraftLocation(BaseModel):
    """Where the draft is and which layers each engine reads (the same list means other layers to SGLang)."""

    path: str  # relative to the acceptance folder
    layout: str
    eagle_aux_hidden_state_layer_ids: list[int]
    layer_ids_convention: str
    sglang: SglangReading


class GateVerdict(BaseModel):
    passed: bool
    reasons: list[str]
    min_train_acceptance_length: float


class GateReport(BaseModel):
    """report.json: the draft's acceptance on each part, how it was trained, the boundary and greedy checks,
    where the draft is, and the verdict."""

    draft_tokens: int
    engine: str
    max_new_tokens: int
    train: PartMeasure
    heldout: PartMeasure
    untrained: PartMeasure
    source_answers: SourceAnswersSkipped | SourceAnswersMeasured
    greedy_check: GreedyCheck
    training: TrainingSummary
    boundaries: BoundaryCheck
    draft: DraftLocation
    feature_ids_output_hidden_states: list[int]
    heldout_ids: list[str]
    device: str
    seconds: dict[str, float]  # by phase, and the total
    gate: GateVerdict
    # the acceptance length the heldout samples' step accuracy implies, beside the served one (None in a
    # report written before it existed)
    simulated: SimulatedAcceptance | None = None

    @property
    def passed(self) -> bool:
        return self.gate.passed

    @property
    def reasons(self) -> list[str]:
        return self.gate.reasons

    @property
    def source_heldout_acceptance_length(self) -> float | None:
        """Heldout acceptance of the draft trained on the source's own answers; None where that arm was
        skipped."""
        s = self.source_answers
        return s.heldout.acceptance_length if isinstance(s, SourceAnswersMeasured) else None

    def to_json(self) -> dict:
        return self.model_dump()

    def write(self, layout: DatasetLayout) -> None:
        write_json(self.to_json(), layout.acceptance_report)


def read_report(layout: DatasetLayout) -> GateReport | None:
    path = layout.acceptance_report
    return GateReport.model_validate_json(path.read_text()) if path.exists() else None


def gate_verdict(
    settings: AcceptanceConfig,
    train: PartMeasure,
    heldout: PartMeasure,
    untrained: PartMeasure,
    boundaries: BoundaryCheck,
    optimizer_steps: int,
) -> GateVerdict:
    """The gate: answer spans where the template puts them, the draft fits its own training prompts
    (acceptance length >= min_train_share x (k + 1)), and heldout beats the untrained draft."""
    need = settings.min_train_share * (settings.draft_tokens + 1)
    reasons = []
    if boundaries.bad:
        sid, why = next(iter(boundaries.examples.items()))
        reasons.append(
            f"{boundaries.bad} of {boundaries.checked} samples have a loss mask off the template's answer "
            f"span (e.g. {sid}: {why})"
        )
    if train.acceptance_length < need:
        reasons.append(
            "the draft does not fit its own training prompts: acceptance length "
            f"{train.acceptance_length:.2f} < {need:.2f} ({settings.min_train_share} x (k + 1)) after "
            f"{optimizer_steps} steps"
        )
    if heldout.acceptance_length <= untrained.acceptance_length:
        reasons.append(
            f"heldout acceptance length {heldout.acceptance_length:.2f} does not beat the untrained draft's "
            f"{untrained.acceptance_length:.2f}"
        )
    return GateVerdict(passed=not reasons, reasons=reasons, min_train_acceptance_length=round(need, 4))
