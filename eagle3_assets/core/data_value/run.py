"""Acceptance per dataset on the common suite: a draft per partition, one on every partition together and,
opt-in, one on all but each, every one trained and measured exactly as the acceptance gate's drafts
(`gate.DraftBench`: same shape, training budget, seed and engine), plus the untrained floor; each figure
beside what its data cost.

Each partition's training samples are the gate's own training split (`samples.split_ids` with its
`train_prompts`), read once and shared by every draft that trains on that partition."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ...config import AcceptanceConfig
from ...config.data_value import ALL_DRAFT, LEAVE_ONE_OUT_PREFIX
from ..acceptance.gate import DraftBench
from ..acceptance.measure import DraftMeasurer, DraftTarget, PromptSet
from ..acceptance.samples import as_train_samples, load_samples, split_ids
from ..hidden_states.reader import HiddenStatesReader, StoredStates
from ..storage.layout import DatasetLayout
from ..target_model.chat import ChatTokenizer
from .loops import is_loop, looping_prompts
from .pricing import BoughtAnswers, price_of_gain
from .suite import Suite
from .suite_answers import SuiteAnswers
from .value_report import FLOOR, DataValueReport, DraftRow, SuiteSummary

ALL = ALL_DRAFT
COST_BASIS = (
    "the whole bought set of the draft's datasets: every stored answer's cost_usd (responses/*.parquet), "
    "not only the answers the draft trained on"
)


@dataclass
class PartitionData:
    """One partition as the drafts see it: its training samples (the gate's split), what its answers cost and
    the seconds its hidden states took to extract."""

    key: str
    samples: list[Any]  # drafter.TrainSample, cropped to the measured window
    labels: list[np.ndarray]  # each sample's trained tokens (the draft vocabulary is built from them)
    bought: BoughtAnswers
    extraction_seconds: float
    feature_ids: list[int]


def read_partition(
    layout: DatasetLayout, settings: AcceptanceConfig, chat: ChatTokenizer, extraction_seconds: float
) -> PartitionData:
    reader = HiddenStatesReader(layout.hidden_states_dir)
    train_ids, _ = split_ids(reader.ids(), settings.train_prompts, 0)
    window = settings.max_new_tokens + (settings.ttt_steps or settings.draft_tokens) + 1
    loaded = load_samples(layout, train_ids, reader, aux_window=window, chat=chat)
    return PartitionData(
        layout.key,
        as_train_samples(loaded, window),
        [s.input_ids[s.loss_mask > 0] for s in loaded],
        BoughtAnswers.read(layout),
        extraction_seconds,
        StoredStates.read(layout.hidden_states_dir).output_hidden_states_ids,
    )


@dataclass(frozen=True)
class DraftPlan:
    name: str
    keys: tuple[str, ...]


def draft_plans(keys: Sequence[str], leave_one_out: bool) -> list[DraftPlan]:
    """A draft per partition, one on all of them, and with `leave_one_out` one on all but each (where at least
    two partitions are left to train on: with two, all-but-one is the other's own draft, reported under both
    names, `draft_row`)."""
    plans = [DraftPlan(k, (k,)) for k in keys]
    plans.append(DraftPlan(ALL, tuple(keys)))
    if leave_one_out and len(keys) > 1:
        plans += [DraftPlan(f"{LEAVE_ONE_OUT_PREFIX}{k}", tuple(x for x in keys if x != k)) for k in keys]
    return plans


@dataclass
class Engines:
    """The draft's pieces of the target and the engine that measures it (the gate's, `gate_engines`)."""

    target: DraftTarget
    measurer: DraftMeasurer
    target_name: str = ""


@dataclass
class Measurement:
    acceptance_length: float
    per_position: list[float]
    outputs: list[list[int]]
    seconds: float
    without_loops: float | None = None
    looping: list[str] = field(default_factory=list)
    # Suite ids whose greedy speculative output differs from the target's greedy answer (None: not compared,
    # the suite was sampled or answered without token ids).
    differs: list[str] | None = None


class ValueRun:
    """Trains and measures the drafts of one report; drafts are served from `scratch` and removed after."""

    def __init__(
        self,
        suite: Suite,
        prompts: PromptSet,
        data: Mapping[str, PartitionData],
        settings: AcceptanceConfig,
        engines: Engines,
        chat: ChatTokenizer,
        scratch: Path,
        log: Callable[[str], None],
        answers: SuiteAnswers | None = None,
    ):
        self.suite, self.prompts, self.data, self.answers = suite, prompts, data, answers
        # Loops judged on the target's own answers (the reference every draft is measured against): a
        # property of the suite, the same for every draft. Without answers, on each draft's output.
        self.reference_loops = None
        if answers is not None:
            self.reference_loops = [sid for sid in prompts.ids if is_loop(answers.answers[sid].text)]
        self.settings, self.engines, self.chat, self.scratch, self.log = (
            settings,
            engines,
            chat,
            scratch,
            log,
        )
        ids = {tuple(d.feature_ids) for d in data.values()}
        if len(ids) > 1:
            raise ValueError(
                "data_value: the partitions' hidden states come from different target layers "
                f"({', '.join(f'{d.key}: {d.feature_ids}' for d in data.values())}); re-extract them alike"
            )
        self.feature_ids = list(next(iter(ids)))

    def bench(self, keys: Sequence[str]) -> DraftBench:
        """The gate's bench for a draft on `keys`: its vocabulary from those partitions' trained tokens."""
        from ..hidden_states.draft_format import DraftShape, build_draft_vocab, count_tokens

        target = self.engines.target
        labels = [a for k in keys for a in self.data[k].labels]
        vocab = build_draft_vocab(count_tokens(labels), target.vocab_size, self.settings.draft_vocab_size)
        return DraftBench(
            shape=DraftShape.from_target(target.config, len(vocab)),
            embedding=target.embedding,
            vocab=vocab,
            measurer=self.engines.measurer,
            settings=self.settings,
            log=self.log,
            layer_ids=self.feature_ids,
            target_name=self.engines.target_name,
        )

    def measure(self, bench: DraftBench, draft: Any, name: str) -> Measurement:
        t0 = time.perf_counter()
        got = bench.measure(draft, self.scratch / name, {"suite": self.prompts}, f"data_value {name}")[
            "suite"
        ]
        m = Measurement(got.part.acceptance_length, got.part.per_position, got.outputs, 0.0)
        m.looping = (
            list(self.reference_loops)
            if self.reference_loops is not None
            else looping_prompts(self.prompts.ids, got.outputs, self.decode)
        )
        if self.answers is not None and self.answers.greedy:
            m.differs = differing_from_target(self.prompts.ids, got.outputs, self.answers)
        clean = [i for i, sid in enumerate(self.prompts.ids) if sid not in m.looping]
        if m.looping and clean:
            part = PromptSet([self.prompts.ids[i] for i in clean], [self.prompts.prompts[i] for i in clean])
            m.without_loops = bench.measure(
                draft, self.scratch / name, {"clean": part}, f"data_value {name} without loops"
            )["clean"].part.acceptance_length
        m.seconds = time.perf_counter() - t0
        return m

    def decode(self, ids: list[int]) -> str:
        return str(self.chat.tok.decode(ids, skip_special_tokens=True))

    def floor(self) -> tuple[DraftRow, Measurement]:
        bench = self.bench(list(self.data))
        m = self.measure(bench, bench.fresh(), FLOOR)
        row = DraftRow(
            draft=FLOOR,
            datasets=[],
            acceptance_length=m.acceptance_length,
            per_position=m.per_position,
            cost_usd=0.0,
            completion_tokens=0,
            gpu_seconds=0.0,
            usd_per_0_1_acceptance=None,
            flags=[
                "floor: the untrained draft every price is measured from",
                *loop_flags(m, len(self.prompts.ids)),
                *target_flags(m, len(self.prompts.ids)),
            ],
            gain_over_floor=0.0,
            n_train_samples=0,
            answers_bought=0,
            extraction_seconds=0.0,
            training_seconds=0.0,
            measure_seconds=round(m.seconds, 1),
            acceptance_length_without_loops=m.without_loops,
            differs_from_target=m.differs,
        )
        return row, m

    def row(self, plan: DraftPlan, floor: float) -> DraftRow:
        bench = self.bench(plan.keys)
        samples = [s for k in plan.keys for s in self.data[k].samples]
        t0 = time.perf_counter()
        draft, stats = bench.fit(samples, f"data_value {plan.name}")
        training = time.perf_counter() - t0
        m = self.measure(bench, draft, plan.name)
        bought = BoughtAnswers.total(self.data[k].bought for k in plan.keys)
        extraction = sum(self.data[k].extraction_seconds for k in plan.keys)
        price = price_of_gain(bought.cost_usd, m.acceptance_length, floor)
        return DraftRow(
            draft=plan.name,
            datasets=list(plan.keys),
            acceptance_length=m.acceptance_length,
            per_position=m.per_position,
            cost_usd=round(bought.cost_usd, 6),
            completion_tokens=bought.completion_tokens,
            gpu_seconds=round(extraction + training, 1),
            usd_per_0_1_acceptance=price.usd_per_0_1_acceptance,
            flags=[
                *price.flags,
                *loop_flags(m, len(self.prompts.ids)),
                *target_flags(m, len(self.prompts.ids)),
            ],
            differs_from_target=m.differs,
            gain_over_floor=round(m.acceptance_length - floor, 4),
            n_train_samples=len(samples),
            answers_bought=bought.answers,
            extraction_seconds=round(extraction, 1),
            training_seconds=round(training, 1),
            measure_seconds=round(m.seconds, 1),
            final_loss=round(stats.final_loss, 4),
            acceptance_length_without_loops=m.without_loops,
        )


def differing_from_target(
    ids: Sequence[str], outputs: Sequence[Sequence[int]], answers: SuiteAnswers
) -> list[str] | None:
    """The suite ids whose decoded output is not the target's greedy answer over their common length (an
    answer may stop at its end of turn before the decoded span ends); None where no answer has token ids."""
    compared, differ = 0, []
    for sid, out in zip(ids, outputs, strict=True):
        ref = answers.answers[sid].output_ids
        if ref is None:
            continue
        n = min(len(ref), len(out))
        compared += 1
        if list(out[:n]) != list(ref[:n]):
            differ.append(sid)
    return differ if compared else None


def target_flags(m: Measurement, n_prompts: int) -> list[str]:
    """A flag where greedy speculative decoding did not reproduce the target's greedy answer: the draft
    changed what the target says (an engine fault), or the two sides ran at other precisions."""
    if not m.differs:
        return []
    return [
        f"differs-from-target: {len(m.differs)} of {n_prompts} greedy outputs are not the target's answer "
        f"({', '.join(m.differs[:5])})"
    ]


def loop_flags(m: Measurement, n_prompts: int) -> list[str]:
    """A flag where the draft's figure includes outputs that loop, with its figure without them."""
    if not m.looping:
        return []
    without = "none left" if m.without_loops is None else f"{m.without_loops:.3f}"
    return [
        f"degenerate-loop: {len(m.looping)} of {n_prompts} suite outputs loop ({', '.join(m.looping[:5])}); "
        f"acceptance length without them: {without}"
    ]


def draft_row(
    run: ValueRun, plan: DraftPlan, floor: float, by_data: dict[tuple[str, ...], DraftRow]
) -> DraftRow:
    """The plan's row; a plan on exactly the data of an earlier one (`all` over one partition, `all-but-A`
    over two) is that draft (same samples, vocabulary and seed): its row under this name, trained and
    measured once, flagged `same-data`."""
    same = by_data.get(plan.keys)
    if same is None:
        by_data[plan.keys] = row = run.row(plan, floor)
        return row
    flag = f"same-data: the draft of {same.draft} (the same training data), trained and measured once"
    return same.model_copy(update={"draft": plan.name, "flags": [*same.flags, flag]})


def run_data_value(
    suite: Suite,
    data: Mapping[str, PartitionData],
    settings: AcceptanceConfig,
    engines: Engines,
    chat: ChatTokenizer,
    folder: Path,
    leave_one_out: bool,
    log: Callable[[str], None] = print,
    answers: SuiteAnswers | None = None,
) -> DataValueReport:
    """Train and measure every draft against the target's `answers` to the suite, write folder/report.json,
    report.md and suite_answers.jsonl."""
    if not data:
        raise ValueError("data_value: no partition has stored hidden states; materialise hidden_states first")
    t_start = time.perf_counter()
    scratch = folder / ".drafts"
    prompts = suite.rendered(chat)
    run = ValueRun(suite, prompts, data, settings, engines, chat, scratch, log, answers)
    try:
        floor_row, floor = run.floor()
        rows = [floor_row]
        by_data: dict[tuple[str, ...], DraftRow] = {}
        for plan in draft_plans(list(data), leave_one_out):
            rows.append(draft_row(run, plan, floor.acceptance_length, by_data))
            log(f"data_value: {plan.name}: acceptance length {rows[-1].acceptance_length:.3f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = DataValueReport(
        suite=SuiteSummary(
            n_prompts=len(suite.prompts),
            source=suite.origin,
            prompt_ids=suite.ids,
            held_out_dataset=suite.held_out_dataset,
            n_source_prompts=suite.n_source_prompts,
            looping_prompt_ids=floor.looping,
            quarantined=suite.quarantined,
            answers=answers.cost() if answers is not None else None,
        ),
        rows=rows,
        floor_acceptance_length=floor.acceptance_length,
        engine=engines.measurer.engine,
        draft_tokens=settings.draft_tokens,
        max_new_tokens=settings.max_new_tokens,
        train_steps=settings.train_steps,
        cost_basis=COST_BASIS,
        seconds={"total": round(time.perf_counter() - t_start, 1)},
        device=engines.measurer.device,
    )
    report.write(folder)
    write_suite_answers(folder, prompts, floor.outputs, run.decode, answers)
    return report


def write_suite_answers(
    folder: Path,
    prompts: PromptSet,
    outputs: Sequence[Sequence[int]],
    decode: Callable[[list[int]], str],
    answers: SuiteAnswers | None = None,
) -> None:
    """`suite_answers.jsonl`, one row per suite prompt: the target's stored answer (`source: target`) and
    the untrained draft's greedy speculative output beside it; without answers, that output alone
    (`source: engine greedy`)."""
    import json

    from ..storage.files import write_text

    lines = []
    for sid, p, o in zip(prompts.ids, prompts.prompts, outputs, strict=True):
        row: dict[str, Any] = {"id": sid, "prompt_tokens": len(p)}
        a = answers.answers[sid] if answers is not None else None
        if a is not None:
            row |= {"source": "target", "output_ids": a.output_ids, "text": a.text}
            row["speculative_output_ids"] = list(o)
        else:
            row |= {"source": "engine greedy", "output_ids": list(o), "text": decode(list(o))}
        lines.append(json.dumps(row))
    write_text("\n".join(lines) + "\n", folder / "suite_answers.jsonl")
