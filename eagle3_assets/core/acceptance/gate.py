"""The acceptance gate: train a small EAGLE-3 draft on a partition's stored hidden states, then measure how many of
its tokens the real target accepts.

The only honest test of EAGLE-3 training data is a drafter trained on it and accepted by the target: a wrong layer,
ids shifted by one, states of other samples or answers that are not the target's own all show up here as low
acceptance, days before a GPU training run would reveal them.

- Split: the partition's samples are ordered by a hash of their id (stable across runs and machines); the first
  `heldout_prompts` are kept out of training, the next `train_prompts` train the draft.
- Boundaries: before training, each sample's loss mask is checked against the target's own chat template, rendered
  afresh from prompts.parquet: the answer's span starts right after the rendered generation prompt and ends on the
  end-of-turn token (a truncated answer at the sequence end). A mask off by one cannot move acceptance measurably in
  a few minutes of training, but it is wrong data all the same, so the gate fails on it explicitly.
- Training: the draft trains from the stored states and ids with two pieces of the target only, its config and
  its embedding (`measure.DraftTarget`, read from the checkpoint by tensor name): the target never has to fit here.
- Measurement: greedy speculative decoding from each prompt with k draft tokens per target forward, by the engine
  the config names (`measure.DraftMeasurer`): this process's loop (`decoding`), or vLLM serving the target with the
  draft as EAGLE-3, its own counters read before and after each part (`resources.vllm.acceptance`). Acceptance
  length = tokens produced per verifying forward (accepted + 1); per-position rates are conditional. A sample of
  heldout prompts is also decoded by the target alone: greedy output with the draft must equal it.
- Source answers: the same draft, trained on the dataset's own assistant turns (tokenized with the same template,
  features from the target over them: `measure.FeatureSource`), is measured on the same heldout prompts: the
  difference is what regeneration buys.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from ...config import AcceptanceConfig
from ..hidden_states.layer_ids import decoder_output_ids
from ..hidden_states.reader import HiddenStatesReader, StoredStates
from ..storage.files import write_json
from ..storage.layout import DatasetLayout
from ..target.chat import Answer, ChatTokenizer, TemplateError
from ..tokens.turns import row_prompts
from .measure import (
    DraftMeasurer,
    DraftTarget,
    FeatureSource,
    Measured,
    PromptSet,
    greedy_differences,
)


@dataclass
class GateSample:
    id: str
    messages: list[dict[str, Any]]
    input_ids: np.ndarray
    loss_mask: np.ndarray
    source_answer: str | None = None
    aux: Any = None  # the auxiliary hidden states (torch), kept for the samples the draft trains on


def split_ids(ids: Sequence[str], n_train: int, n_heldout: int) -> tuple[list[str], list[str]]:
    """(train, heldout) ids, ordered by a hash of the id: stable, and independent of how rows are stored."""
    order = sorted(ids, key=lambda i: hashlib.blake2b(i.encode(), digest_size=8).digest())
    heldout = min(n_heldout, max(1, len(order) // 4)) if len(order) >= 2 else 0
    return order[heldout : heldout + n_train], order[:heldout]


def answer_span(mask: np.ndarray) -> tuple[int, int] | None:
    """[start, end) of the last run of 1s in the loss mask (the answer the target gave)."""
    ones = np.flatnonzero(mask > 0)
    if not len(ones):
        return None
    end = int(ones[-1]) + 1
    gaps = np.flatnonzero(np.diff(ones) > 1)
    start = int(ones[gaps[-1] + 1]) if len(gaps) else int(ones[0])
    return start, end


def boundary_problem(sample: GateSample, prompt_ids: list[int], stop_ids: set[int]) -> str | None:
    """Why this sample's answer span is not where the template puts it, or None."""
    span = answer_span(sample.loss_mask)
    if span is None:
        return "no loss-mask tokens"
    start, end = span
    if list(sample.input_ids[:start]) != prompt_ids:
        return (
            f"the answer's loss mask starts at {start}, the rendered generation prompt is {len(prompt_ids)} "
            "tokens (or its ids differ)"
        )
    if int(sample.input_ids[end - 1]) not in stop_ids and end != len(sample.input_ids):
        return f"the answer's loss mask ends at {end} on token {int(sample.input_ids[end - 1])}, not on end-of-turn"
    return None


def rendered_prompts(chat: ChatTokenizer, samples: Sequence[GateSample]) -> list[list[int]]:
    """Each sample's generation prompt as a server tokenizes it: the template's text, encoded by the tokenizer."""
    return [
        chat.tok(chat.render(chat.template_messages(s.messages), True), add_special_tokens=False)["input_ids"]
        for s in samples
    ]


@dataclass
class GateResult:
    report: dict[str, Any]
    passed: bool
    reasons: list[str] = field(default_factory=list)


def load_samples(
    layout: DatasetLayout,
    ids: Sequence[str],
    reader: HiddenStatesReader | None = None,
    aux_window: int | None = None,
    chat: ChatTokenizer | None = None,
) -> list[GateSample]:
    """The samples' ids and masks from the hidden-states shards and their messages: a prompt's row as
    prompts.parquet has it, a row of `turns: all` (`<id>#t<k>`) as the model saw turn k (the source with the
    target's stored answers to turns 1..k-1; `chat` says whether the template keeps their reasoning). With
    `aux_window`, each sample also keeps its auxiliary states up to that many tokens into its answer (what the
    draft trains on, see crop_to_window), copied so that the rest of the sample's states is freed: each sample is
    read once, and memory holds only the windows."""
    keep_reasoning = chat.template_has_reasoning if chat is not None else True
    by_id = row_prompts(layout, pl.read_parquet(layout.prompts), ids, keep_reasoning)
    reader = reader or HiddenStatesReader(layout.hidden_states_dir)
    out = []
    for sid in ids:
        row = by_id.get(sid)
        if row is None:
            raise ValueError(
                f"{sid}: in hidden_states but neither a prompt of prompts.parquet nor a stored turn of one; "
                "re-materialise hidden_states"
            )
        s = reader.sample(sid)
        out.append(
            GateSample(
                sid,
                row["messages"],
                s["input_ids"].numpy(),
                s["loss_mask"].numpy(),
                row["source_answer"],
                None if aux_window is None else _aux_window(s, aux_window),
            )
        )
    return out


def _aux_window(sample: dict[str, Any], window: int) -> Any:
    span = answer_span(sample["loss_mask"].numpy())
    end = len(sample["input_ids"]) if span is None else min(len(sample["input_ids"]), span[0] + window)
    return sample["aux_hidden_states"][:end].clone()


@dataclass
class DraftBench:
    """What every draft of one gate run shares: its shape and vocabulary, the target's frozen embedding, the engine
    that measures it, and the training settings."""

    shape: Any
    embedding: Any
    vocab: Any
    measurer: DraftMeasurer
    settings: AcceptanceConfig
    log: Callable[[str], None]
    layer_ids: list[int] = field(default_factory=list)  # output_hidden_states ids (vLLM's reading)
    target_name: str = ""

    def fresh(self) -> Any:
        """A draft at initialisation (the same seed every time: the untrained floor and every fit start here)."""
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
                f"acceptance: {what}, {name} prompts: {m.part.acceptance_length:.2f} tokens per target forward "
                f"over {m.part.n_steps} steps ({self.measurer.engine})"
            )
        self.log(f"acceptance: {what} measured in {time.perf_counter() - t0:.0f} s")
        return out


def as_train_samples(samples: Sequence[GateSample], window: int) -> list[Any]:
    """Gate samples (loaded with their aux window) as the drafter's training samples, cropped to that window."""
    import torch

    from .drafter import TrainSample

    return [
        crop_to_window(
            TrainSample(
                torch.from_numpy(s.input_ids.astype(np.int64)),
                torch.from_numpy(s.loss_mask.astype(np.int64)),
                s.aux.float(),
            ),
            window,
        )
        for s in samples
    ]


def boundary_problems(
    samples: Sequence[GateSample], prompts: Sequence[list[int]], stop_ids: set[int]
) -> dict[str, str]:
    """Samples whose loss mask is off the answer span of the template rendered afresh, with why."""
    problems = {}
    for s, p in zip(samples, prompts, strict=True):
        why = boundary_problem(s, p, stop_ids)
        if why:
            problems[s.id] = why
    return problems


@dataclass
class GateEngines:
    """What the gate runs on: the draft's pieces of the target, the engine that measures drafts, and where the
    source-answers arm gets the target's states (None: that arm is skipped, saying why)."""

    target: DraftTarget
    measurer: DraftMeasurer
    features: FeatureSource | None
    target_name: str = ""
    no_features_why: str = ""


@dataclass
class GateInputs:
    """The partition's samples as the gate splits them, with their rendered prompts and boundary problems."""

    train: list[GateSample]
    heldout: list[GateSample]
    train_prompts: PromptSet
    heldout_prompts: PromptSet
    problems: dict[str, str]
    window: int


def gate_inputs(
    layout: DatasetLayout, settings: AcceptanceConfig, chat: ChatTokenizer, stop_ids: set[int]
) -> GateInputs:
    """Split, load (training samples with their aux window), render the prompts and check the boundaries."""
    reader = HiddenStatesReader(layout.hidden_states_dir)
    all_ids = reader.ids()
    train_ids, heldout_ids = split_ids(all_ids, settings.train_prompts, settings.heldout_prompts)
    if not train_ids or not heldout_ids:
        raise ValueError(
            f"{layout.key}: {len(all_ids)} samples with hidden states; the gate needs at least 2 "
            "(some to train on, some held out)"
        )
    window = settings.max_new_tokens + (settings.ttt_steps or settings.draft_tokens) + 1
    train = load_samples(layout, train_ids, reader, aux_window=window, chat=chat)
    heldout = load_samples(layout, heldout_ids, reader, chat=chat)
    prompts = rendered_prompts(chat, train + heldout)
    return GateInputs(
        train,
        heldout,
        PromptSet(train_ids, prompts[: len(train)]),
        PromptSet(heldout_ids, prompts[len(train) :]),
        boundary_problems(train + heldout, prompts, stop_ids),
        window,
    )


def run_gate(
    layout: DatasetLayout,
    settings: AcceptanceConfig,
    engines: GateEngines,
    chat: ChatTokenizer,
    log: Callable[[str], None] = print,
) -> GateResult:
    """Train, measure, write <B>/acceptance/report.json and the draft checkpoint, and decide the gate: the verdict
    is computed here, once, and stored in the report (the asset and its check read it)."""
    import shutil

    from ..hidden_states.draft_format import DraftShape, build_draft_vocab, count_tokens

    t_start = time.perf_counter()
    k = settings.draft_tokens
    feature_ids = StoredStates.read(layout.hidden_states_dir).output_hidden_states_ids
    stop_ids = chat.stop_ids
    data = gate_inputs(layout, settings, chat, stop_ids)
    regenerated = as_train_samples(data.train, data.window)
    labels = [s.input_ids[s.loss_mask > 0] for s in data.train]
    vocab = build_draft_vocab(count_tokens(labels), engines.target.vocab_size, settings.draft_vocab_size)
    bench = DraftBench(
        shape=DraftShape.from_target(engines.target.config, len(vocab)),
        embedding=engines.target.embedding,
        vocab=vocab,
        measurer=engines.measurer,
        settings=settings,
        log=log,
        layer_ids=list(feature_ids),
        target_name=engines.target_name,
    )
    scratch = layout.acceptance_dir / ".drafts"  # the drafts measured but not kept (served from a folder)
    seconds: dict[str, float] = {}
    try:
        t0 = time.perf_counter()
        untrained = bench.measure(
            bench.fresh(), scratch / "untrained", {"heldout": data.heldout_prompts}, "untrained draft"
        )
        seconds["measure_untrained"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        draft, stats = bench.fit(regenerated, "regenerated answers")
        seconds["train"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        # The fit is measured on as many training prompts as are held out (enough to see it, at half the cost).
        n_fit = len(data.heldout_prompts.ids)
        trained = bench.measure(
            draft,
            layout.draft_dir,
            {"train": data.train_prompts.head(n_fit), "heldout": data.heldout_prompts},
            "trained draft",
        )
        seconds["measure_trained"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        checked = data.heldout_prompts.head(settings.vllm.greedy_check_prompts)
        greedy = greedy_differences(
            checked, trained["heldout"].outputs[: len(checked.ids)], engines.measurer.greedy(checked)
        )
        seconds["greedy_check"] = time.perf_counter() - t0
        source_part = source_answers_part(bench, engines, data, chat, scratch, seconds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    seconds["total"] = time.perf_counter() - t_start
    report = {
        "draft_tokens": k,
        "engine": engines.measurer.engine,
        "max_new_tokens": settings.max_new_tokens,
        "train": asdict(trained["train"].part),
        "heldout": asdict(trained["heldout"].part),
        "untrained": asdict(untrained["heldout"].part),
        "source_answers": source_part,
        "greedy_check": greedy,
        "training": {
            "optimizer_steps": stats.steps,
            "ttt_steps": settings.ttt_steps or k,
            "samples": len(regenerated),
            "tokens_seen": stats.tokens_seen,
            "first_loss": round(stats.first_loss, 4),
            "final_loss": round(stats.final_loss, 4),
            "final_step_accuracy": [round(a, 4) for a in stats.final_step_accuracy],
            "draft_vocab_size": bench.shape.draft_vocab_size,
        },
        "boundaries": {
            "checked": len(data.train) + len(data.heldout),
            "bad": len(data.problems),
            "examples": dict(list(data.problems.items())[:5]),
        },
        "draft": draft_report(layout, feature_ids),
        "feature_ids_output_hidden_states": list(feature_ids),
        "heldout_ids": data.heldout_prompts.ids,
        "device": engines.measurer.device,
        "seconds": {k_: round(v, 1) for k_, v in seconds.items()},
    }
    passed, reasons = gate_verdict(report, settings)
    report["gate"] = {
        "passed": passed,
        "reasons": reasons,
        "min_train_acceptance_length": round(settings.min_train_share * (k + 1), 4),
    }
    write_json(report, layout.acceptance_report)
    return GateResult(report, passed, reasons)


def draft_report(layout: DatasetLayout, feature_ids: Sequence[int]) -> dict[str, Any]:
    """Where the draft is and which layers each engine must read (the same list means other layers to SGLang)."""
    from .drafter import SGLANG_CONFIG

    return {
        "path": str(layout.draft_dir.relative_to(layout.acceptance_dir)),
        "layout": "EAGLE-3 draft (LlamaForCausalLMEagle3: config.json + model.safetensors)",
        "eagle_aux_hidden_state_layer_ids": list(feature_ids),
        "layer_ids_convention": "output_hidden_states indices, as vLLM reads config.json",
        "sglang": {
            "config": SGLANG_CONFIG,
            "eagle_aux_hidden_state_layer_ids": decoder_output_ids(feature_ids),
            "how": f"SGLang adds one to each id: serve the folder with {SGLANG_CONFIG} as its config.json",
        },
    }


def source_answers_part(
    bench: DraftBench,
    engines: GateEngines,
    data: GateInputs,
    chat: ChatTokenizer,
    scratch: Path,
    seconds: dict[str, float],
) -> dict[str, Any]:
    """The same draft trained on the dataset's own answers, measured on the same heldout prompts."""
    settings = bench.settings
    with_source = [s for s in data.train if s.source_answer and s.source_answer.strip()]
    if not settings.compare_source_answers:
        return {"skipped": "acceptance.compare_source_answers is false"}
    if len(with_source) < max(2, len(data.train) // 2):
        return {
            "skipped": f"{len(with_source)} of {len(data.train)} training prompts have an answer in the source"
        }
    if engines.features is None:
        return {"skipped": engines.no_features_why}
    t0 = time.perf_counter()
    original = source_samples(with_source, chat, engines.features, data.window)
    src_draft, src_stats = bench.fit(original, "source answers")
    measured = bench.measure(
        src_draft, scratch / "source", {"heldout": data.heldout_prompts}, "source-answer draft"
    )
    seconds["source_answers"] = time.perf_counter() - t0
    return {
        "n_samples": len(original),
        "heldout": asdict(measured["heldout"].part),
        "train_final_loss": round(src_stats.final_loss, 4),
    }


def gate_verdict(report: dict[str, Any], settings: AcceptanceConfig) -> tuple[bool, list[str]]:
    """The gate: answer spans where the template puts them, the draft fits its own training prompts
    (acceptance length >= min_train_share x (k + 1)), and heldout beats the untrained draft."""
    k = report["draft_tokens"]
    need = settings.min_train_share * (k + 1)
    train, heldout, floor = report["train"], report["heldout"], report["untrained"]
    reasons = []
    b = report["boundaries"]
    if b["bad"]:
        sid, why = next(iter(b["examples"].items()))
        reasons.append(
            f"{b['bad']} of {b['checked']} samples have a loss mask off the template's answer span (e.g. {sid}: {why})"
        )
    if train["acceptance_length"] < need:
        reasons.append(
            f"the draft does not fit its own training prompts: acceptance length {train['acceptance_length']:.2f} "
            f"< {need:.2f} ({settings.min_train_share} x (k + 1)) after {report['training']['optimizer_steps']} steps"
        )
    if heldout["acceptance_length"] <= floor["acceptance_length"]:
        reasons.append(
            f"heldout acceptance length {heldout['acceptance_length']:.2f} does not beat the untrained draft's "
            f"{floor['acceptance_length']:.2f}"
        )
    return not reasons, reasons


def crop_to_window(sample: Any, window: int) -> Any:
    """The sample up to `window` tokens into its answer: the gate measures the first max_new_tokens of each
    answer, so that is the span the draft must fit (training on the rest would cost minutes and change nothing
    the fit is measured on)."""
    from .drafter import TrainSample

    span = answer_span(sample.loss_mask.numpy())
    if span is None:
        return sample
    end = min(len(sample.input_ids), span[0] + window)
    return TrainSample(sample.input_ids[:end], sample.loss_mask[:end], sample.aux[:end])


def source_samples(
    samples: Sequence[GateSample], chat: ChatTokenizer, features: FeatureSource, window: int
) -> list[Any]:
    """The dataset's own answers as training samples: tokenized with the target's template, features from the
    target over them."""
    import torch

    from .drafter import TrainSample

    convs = [(list(s.messages), Answer(str(s.source_answer), None, True)) for s in samples]
    rows = [r for r in chat.tokenize(convs) if not isinstance(r, TemplateError)]
    states = features.aux_states([r.input_ids for r in rows])
    return [
        crop_to_window(
            TrainSample(
                torch.from_numpy(r.input_ids.astype(np.int64)),
                torch.from_numpy(r.loss_mask.astype(np.int64)),
                aux,
            ),
            window,
        )
        for r, aux in zip(rows, states, strict=True)
    ]


def read_report(layout: DatasetLayout) -> dict[str, Any] | None:
    path = layout.acceptance_report
    return json.loads(path.read_text()) if path.exists() else None
