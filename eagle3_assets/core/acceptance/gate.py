"""The acceptance gate: train a small EAGLE-3 draft on a partition's stored hidden states, then measure how
many of its tokens the real target accepts.

The only honest test of EAGLE-3 training data is a drafter trained on it and accepted by the target: a wrong
layer, ids shifted by one, states of other samples or answers that are not the target's own all show up here
as low acceptance, days before a GPU training run would reveal them.

- Split: the partition's samples are ordered by a hash of their id (stable across runs and machines); the
  first `heldout_prompts` are kept out of training, the next `train_prompts` train the draft.
- Boundaries: before training, each sample's loss mask is checked against the target's own chat template,
  rendered afresh from prompts.parquet: the answer's span starts right after the rendered generation prompt
  and ends on the end-of-turn token (a truncated answer at the sequence end). A mask off by one cannot move
  acceptance measurably in a few minutes of training, but it is wrong data all the same, so the gate fails on
  it explicitly.
- Training: the draft trains from the stored states and ids with two pieces of the target only, its config and
  its embedding (`measure.DraftTarget`, read from the checkpoint by tensor name): the target never has to fit
  here.
- Measurement: greedy speculative decoding from each prompt with k draft tokens per target forward, by the
  engine the config names (`measure.DraftMeasurer`): this process's loop (`decoding`), or vLLM serving the
  target with the draft as EAGLE-3, its own counters read before and after each part
  (`resources.vllm.acceptance`). Acceptance length = tokens produced per verifying forward (accepted + 1);
  per-position rates are conditional. A sample of heldout prompts is also decoded by the target alone: greedy
  output with the draft must equal it.
- Source answers: the same draft, trained on the dataset's own assistant turns (tokenized with the same
  template, features from the target over them: `measure.FeatureSource`), is measured on the same heldout
  prompts: the difference is what regeneration buys.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...config import AcceptanceConfig
from ..hidden_states.layer_ids import decoder_output_ids
from ..hidden_states.reader import StoredStates
from ..storage.layout import DatasetLayout
from ..target_model.chat import ChatTokenizer
from .gate_report import (
    BoundaryCheck,
    DraftLocation,
    GateReport,
    SglangReading,
    SourceAnswersMeasured,
    SourceAnswersSkipped,
    TrainingSummary,
    gate_verdict,
)
from .measure import (
    DraftMeasurer,
    DraftTarget,
    FeatureSource,
    Measured,
    PartMeasure,
    PromptSet,
    greedy_differences,
)
from .samples import GateInputs, as_train_samples, gate_inputs, source_samples
from .simulated import SimulatedAcceptance, implied_acceptance_length, simulated_beside_served


@dataclass
class DraftBench:
    """What every draft of one gate run shares: its shape and vocabulary, the target's frozen embedding, the
    engine that measures it, and the training settings."""

    shape: Any
    embedding: Any
    vocab: Any
    measurer: DraftMeasurer
    settings: AcceptanceConfig
    log: Callable[[str], None]
    layer_ids: list[int] = field(default_factory=list)  # output_hidden_states ids (vLLM's reading)
    target_name: str = ""

    def fresh(self) -> Any:
        """A draft at initialisation (the same seed every time: the untrained floor and every fit start
        here)."""
        import torch

        from .drafter import Eagle3Draft

        torch.manual_seed(self.settings.seed)
        return Eagle3Draft(self.shape, self.embedding, self.vocab)

    def fit(self, samples: list[Any], what: str) -> tuple[Any, Any]:
        from .drafter import train

        s = self.settings
        draft = self.fresh()
        stats = train(
            draft,
            samples,
            optimizer_steps=s.train_steps,
            ttt_steps=s.ttt_steps or s.draft_tokens,
            lr=s.learning_rate,
            max_batch_tokens=s.batch_tokens,
            seed=s.seed,
            log=lambda m: self.log(f"{what}: {m}"),
        )
        return draft, stats

    def measure(
        self, draft: Any, folder: Path, parts: dict[str, PromptSet], what: str
    ) -> dict[str, Measured]:
        """The parts measured with the draft (saved in `folder` first: an engine serves it from there)."""
        from .drafter import save_checkpoint

        save_checkpoint(draft, folder, self.layer_ids, self.target_name)
        t0 = time.perf_counter()
        out = self.measurer.measure(draft, folder, parts)
        for name, m in out.items():
            self.log(
                f"acceptance: {what}, {name} prompts: {m.part.acceptance_length:.2f} tokens per target "
                f"forward over {m.part.n_steps} steps ({self.measurer.engine})"
            )
        self.log(f"acceptance: {what} measured in {time.perf_counter() - t0:.0f} s")
        return out


@dataclass
class GateEngines:
    """What the gate runs on: the draft's pieces of the target, the engine that measures drafts, and where the
    source-answers arm gets the target's states (None: that arm is skipped, saying why)."""

    target: DraftTarget
    measurer: DraftMeasurer
    features: FeatureSource | None
    target_name: str = ""
    no_features_why: str = ""


def run_gate(
    layout: DatasetLayout,
    settings: AcceptanceConfig,
    engines: GateEngines,
    chat: ChatTokenizer,
    log: Callable[[str], None] = print,
) -> GateReport:
    """Train, measure, write <B>/acceptance/report.json and the draft checkpoint, and decide the gate: the
    verdict is computed here, once, and stored in the report (the asset and its check read it)."""
    import shutil

    t_start = time.perf_counter()
    feature_ids = StoredStates.read(layout.hidden_states_dir).output_hidden_states_ids
    data = gate_inputs(layout, settings, chat, chat.stop_ids)
    run = GateRun(layout, draft_bench(data, settings, engines, feature_ids, log), engines, data, chat)
    try:
        report = run.measured()
    finally:
        shutil.rmtree(run.scratch, ignore_errors=True)
    seconds = {**report.seconds, "total": time.perf_counter() - t_start}
    report.seconds = {k: round(v, 1) for k, v in seconds.items()}
    report.write(layout)
    return report


def draft_bench(
    data: GateInputs,
    settings: AcceptanceConfig,
    engines: GateEngines,
    feature_ids: list[int],
    log: Callable[[str], None],
) -> DraftBench:
    """The drafts' shape and vocabulary: the target's width, the tokens the training answers use most."""
    from ..hidden_states.draft_format import DraftShape, build_draft_vocab, count_tokens

    labels = [s.input_ids[s.loss_mask > 0] for s in data.train]
    vocab = build_draft_vocab(count_tokens(labels), engines.target.vocab_size, settings.draft_vocab_size)
    return DraftBench(
        shape=DraftShape.from_target(engines.target.config, len(vocab)),
        embedding=engines.target.embedding,
        vocab=vocab,
        measurer=engines.measurer,
        settings=settings,
        log=log,
        layer_ids=list(feature_ids),
        target_name=engines.target_name,
    )


@dataclass
class GateRun:
    """One gate's phases, each timed: the untrained floor, the fit on the regenerated answers, its
    measurement, the greedy check and the source-answers arm. Drafts measured but not kept are served from
    `scratch`."""

    layout: DatasetLayout
    bench: DraftBench
    engines: GateEngines
    data: GateInputs
    chat: ChatTokenizer
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def scratch(self) -> Path:
        return self.layout.acceptance_dir / ".drafts"

    @contextmanager
    def timed(self, phase: str) -> Iterator[None]:
        t0 = time.perf_counter()
        yield
        self.seconds[phase] = time.perf_counter() - t0

    def measured(self) -> GateReport:
        """Every phase, then the report with its verdict (its seconds without the total, unrounded)."""
        bench, data, settings = self.bench, self.data, self.bench.settings
        regenerated = as_train_samples(data.train, data.window)
        with self.timed("measure_untrained"):
            untrained = bench.measure(
                bench.fresh(),
                self.scratch / "untrained",
                {"heldout": data.heldout_prompts},
                "untrained draft",
            )["heldout"]
        with self.timed("train"):
            draft, stats = bench.fit(regenerated, "regenerated answers")
        with self.timed("measure_trained"):
            # The fit is measured on as many training prompts as are held out (enough to see it, at half the
            # cost).
            parts = {
                "train": data.train_prompts.head(len(data.heldout_prompts.ids)),
                "heldout": data.heldout_prompts,
            }
            trained = bench.measure(draft, self.layout.draft_dir, parts, "trained draft")
        with self.timed("simulate"):
            simulated = self.simulated(draft, trained["heldout"].part)
        with self.timed("greedy_check"):
            checked = data.heldout_prompts.head(settings.vllm.greedy_check_prompts)
            drafted = trained["heldout"].outputs[: len(checked.ids)]
            greedy = greedy_differences(checked, drafted, self.engines.measurer.greedy(checked))
        source = self.source_answers()
        boundaries = BoundaryCheck(
            checked=len(data.train) + len(data.heldout),
            bad=len(data.problems),
            examples=dict(list(data.problems.items())[:5]),
        )
        train, heldout = trained["train"].part, trained["heldout"].part
        return GateReport(
            draft_tokens=settings.draft_tokens,
            engine=self.engines.measurer.engine,
            max_new_tokens=settings.max_new_tokens,
            train=train,
            heldout=heldout,
            untrained=untrained.part,
            source_answers=source,
            greedy_check=greedy,
            training=TrainingSummary(
                optimizer_steps=stats.steps,
                ttt_steps=settings.ttt_steps or settings.draft_tokens,
                samples=len(regenerated),
                tokens_seen=stats.tokens_seen,
                first_loss=round(stats.first_loss, 4),
                final_loss=round(stats.final_loss, 4),
                final_step_accuracy=[round(a, 4) for a in stats.final_step_accuracy],
                draft_vocab_size=bench.shape.draft_vocab_size,
                simulated_acceptance_length=round(
                    implied_acceptance_length(stats.final_step_accuracy, settings.draft_tokens), 4
                ),
            ),
            boundaries=boundaries,
            draft=draft_location(self.layout, bench.layer_ids),
            feature_ids_output_hidden_states=list(bench.layer_ids),
            heldout_ids=data.heldout_prompts.ids,
            device=self.engines.measurer.device,
            seconds=self.seconds,
            gate=gate_verdict(settings, train, heldout, untrained.part, boundaries, stats.steps),
            simulated=simulated,
        )

    def simulated(self, draft: Any, served: PartMeasure) -> SimulatedAcceptance:
        """The acceptance length the heldout samples' step accuracy implies (teacher-forced through the
        trained draft), beside the one the engine measured on the same prompts."""
        from .drafter import step_accuracy

        s = self.bench.settings
        heldout = as_train_samples(self.data.heldout, self.data.window)
        k = s.draft_tokens
        rates = step_accuracy(draft, heldout, k, s.batch_tokens)
        out = simulated_beside_served(rates, k, len(heldout), served.acceptance_length)
        self.bench.log(
            "acceptance: simulated from heldout step accuracy "
            f"{', '.join(f'{a:.2f}' for a in out.per_position)}: {out.acceptance_length:.2f} tokens per "
            f"target forward; served {served.acceptance_length:.2f} (served / simulated "
            f"{out.served_over_simulated})"
        )
        return out

    def source_answers(self) -> SourceAnswersSkipped | SourceAnswersMeasured:
        """The same draft trained on the dataset's own answers, measured on the same heldout prompts."""
        bench, data, engines = self.bench, self.data, self.engines
        with_source = [s for s in data.train if s.source_answer and s.source_answer.strip()]
        if not bench.settings.compare_source_answers:
            return SourceAnswersSkipped(skipped="acceptance.compare_source_answers is false")
        if len(with_source) < max(2, len(data.train) // 2):
            return SourceAnswersSkipped(
                skipped=f"{len(with_source)} of {len(data.train)} training prompts have an answer in the "
                "source"
            )
        if engines.features is None:
            return SourceAnswersSkipped(skipped=engines.no_features_why)
        with self.timed("source_answers"):
            original = source_samples(with_source, self.chat, engines.features, data.window)
            src_draft, src_stats = bench.fit(original, "source answers")
            measured = bench.measure(
                src_draft, self.scratch / "source", {"heldout": data.heldout_prompts}, "source-answer draft"
            )
        return SourceAnswersMeasured(
            n_samples=len(original),
            heldout=measured["heldout"].part,
            train_final_loss=round(src_stats.final_loss, 4),
        )


def draft_location(layout: DatasetLayout, feature_ids: list[int]) -> DraftLocation:
    """The report's `draft`: where the draft is and which layers each engine reads."""
    from .drafter import SGLANG_CONFIG

    return DraftLocation(
        path=str(layout.draft_dir.relative_to(layout.acceptance_dir)),
        layout="EAGLE-3 draft (LlamaForCausalLMEagle3: config.json + model.safetensors)",
        eagle_aux_hidden_state_layer_ids=list(feature_ids),
        layer_ids_convention="output_hidden_states indices, as vLLM reads config.json",
        sglang=SglangReading(
            config=SGLANG_CONFIG,
            eagle_aux_hidden_state_layer_ids=decoder_output_ids(feature_ids),
            how=f"SGLang adds one to each id: serve the folder with {SGLANG_CONFIG} as its config.json",
        ),
    )
