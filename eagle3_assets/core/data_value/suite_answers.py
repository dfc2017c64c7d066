"""The suite answered by the target like any partition: its prompts stored as a partition's
(`DataValueLayout.suite`, `<root>/data_value/suite/`), answered through the generation stage's own machinery
(`generation.run.generate_responses`: the configured backend, its journal, resume by id and fingerprint, the
target's identity), so an answer is bought once and a rerun sends nothing; and what it cost.

The answers are `acceptance.max_new_tokens` long, the span every draft decodes: they are the reference a
draft's decoded output is compared with (a greedy speculative output must equal the target's greedy answer)
and where loops are judged (a target that repeats itself makes any draft look good)."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import polars as pl

from ...config import DatasetConfig, ProjectConfig, SamplingConfig
from ..generation.binding import AnswerRules, sampling_fingerprints, served_models
from ..generation.engine_settings import EngineSettings
from ..generation.identity import TargetIdentity
from ..generation.protocol import InferenceBackend
from ..generation.run import GenerationPlan, GenerationSummary, generate_responses
from ..prompts.ingest import read_prompts
from ..storage.files import write_parquet
from ..storage.layout import DatasetLayout
from ..storage.tables import RESPONSE_SCHEMA, JournalTable
from ..target_model.chat import ChatTokenizer
from .pricing import BoughtAnswers
from .suite import Suite
from .value_report import SuiteCost

SUITE_KEY = "suite"  # the plan's key: what the generation logs name the suite


def suite_sampling(cfg: ProjectConfig) -> SamplingConfig:
    """The held-out dataset's sampling where the suite is one, else the project's."""
    s = cfg.data_value.suite if cfg.data_value else None
    return cfg.sampling_for(s.dataset) if s is not None and s.dataset else cfg.sampling


def suite_dataset(cfg: ProjectConfig) -> DatasetConfig:
    """The suite as a dataset section: the held-out dataset's or the suite's own source and format, its
    answers `acceptance.max_new_tokens` long (the span the drafts decode), one answer per prompt."""
    assert cfg.data_value is not None
    s = cfg.data_value.suite
    base = (
        cfg.dataset(s.dataset)
        if s.dataset is not None
        else DatasetConfig(
            source=str(s.source), format=s.format, fields=s.fields, system_prompt=s.system_prompt
        )
    )
    return base.model_copy(update={"max_tokens": cfg.acceptance.max_new_tokens, "turns": "last"})


def suite_rules(cfg: ProjectConfig, sampling: SamplingConfig) -> AnswerRules:
    """What a stored suite answer must match to stand (as `AnswerRules.from_config` for a dataset): the
    sampling and template it was asked with, per backend, and the target's served names."""
    return AnswerRules("last", sampling_fingerprints(cfg, sampling), served_models(cfg))


def store_suite_prompts(suite: Suite, layout: DatasetLayout) -> None:
    """The suite's rows as the suite partition's prompts.parquet, rewritten only where they changed (an
    unchanged file keeps its identity, and the answers their binding)."""
    assert suite.frame is not None
    layout.ensure()
    if layout.prompts.exists():
        stored = read_prompts(layout.prompts)
        if stored.select("id", "messages").equals(suite.frame.select("id", "messages")):
            return
    write_parquet(suite.frame, layout.prompts)


@dataclass(frozen=True)
class SuiteAnswer:
    id: str
    text: str
    output_ids: list[int] | None  # None where the backend returned no ids


@dataclass
class SuiteAnswers:
    """The target's standing answers to the suite and what buying them cost."""

    answers: dict[str, SuiteAnswer]
    bought: BoughtAnswers  # every stored suite answer, whichever run bought it
    sent_this_run: int
    backend: str
    greedy: bool
    unanswered: list[str] = field(default_factory=list)
    seconds: float = 0.0  # this run's generation, nothing sent included

    def cost(self) -> SuiteCost:
        b = self.bought
        return SuiteCost(
            backend=self.backend,
            answers=b.answers,
            cost_usd=round(b.cost_usd, 6),
            completion_tokens=b.completion_tokens,
            priced_answers=b.priced_answers,
            sent_this_run=self.sent_this_run,
            seconds=round(self.seconds, 1),
            greedy=self.greedy,
        )

    @classmethod
    def read(
        cls, layout: DatasetLayout, ids: list[str], summary: GenerationSummary | None, greedy: bool
    ) -> SuiteAnswers:
        df = (
            JournalTable(layout.responses_dir, RESPONSE_SCHEMA).read(keep="last")
            if layout.responses_dir.exists()
            else pl.DataFrame(schema=RESPONSE_SCHEMA)
        )
        rows = {r["id"]: r for r in df.select("id", "content", "output_ids").iter_rows(named=True)}
        answers = {
            i: SuiteAnswer(i, rows[i]["content"] or "", rows[i]["output_ids"]) for i in ids if i in rows
        }
        sent = summary.report.sent if summary is not None and summary.report is not None else 0
        return cls(
            answers,
            BoughtAnswers.read(layout),
            int(sent),
            summary.backend if summary is not None else "",
            greedy,
            [i for i in ids if i not in rows],
        )


def answer_suite(
    cfg: ProjectConfig,
    suite: Suite,
    layout: DatasetLayout,
    backend: InferenceBackend,
    chat: ChatTokenizer,
    settings: EngineSettings,
    log: Callable[[str], None],
    lock: Callable[[str], AbstractContextManager] | None = None,
    on_flush: Callable[[], None] | None = None,
) -> SuiteAnswers:
    """Every suite prompt without a standing answer asked of the target (nothing where all stand), then the
    standing answers read back. Refuses (ValueError) where a suite prompt is left unanswered: a draft must
    not be measured against a reference that is not there."""
    store_suite_prompts(suite, layout)
    sampling = suite_sampling(cfg)
    plan = GenerationPlan(
        key=SUITE_KEY,
        dataset=suite_dataset(cfg),
        sampling=sampling,
        rules=suite_rules(cfg, sampling),
        target=TargetIdentity.from_config(cfg),
        # Answers of an earlier target are no reference for this one's drafts: set aside, asked again (only
        # where the recorded target conflicts; the same target's answers stand and are never bought twice).
        fresh_answers=True,
    )
    t0 = time.perf_counter()
    summary = generate_responses(layout, plan, backend, chat, settings, log, lock=lock, on_flush=on_flush)
    got = SuiteAnswers.read(layout, suite.ids, summary, sampling.temperature == 0)
    got.seconds = time.perf_counter() - t0
    if got.unanswered:
        raise ValueError(
            f"data_value: the target left {len(got.unanswered)} suite prompt(s) unanswered "
            f"({', '.join(got.unanswered[:10])}; stop reason {summary.stop_reason}); see the failures in "
            f"{layout.failures_dir}. Nothing was trained"
        )
    return got
