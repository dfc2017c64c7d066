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
- Measurement: greedy speculative decoding from each prompt with k draft tokens per target forward. The features are
  the target's own `output_hidden_states` at the ids the speculators export declares (an independent path from the
  extraction hooks), the draft's own states carry its later steps (EAGLE-3's chain), and the target verifies all k
  drafts in one forward with its KV cache. Acceptance length = tokens produced per verifying forward (accepted + 1);
  per-position rates are conditional (position i counted only where 1..i-1 were accepted).
- Source answers: the same draft, trained on the dataset's own assistant turns (tokenized with the same template,
  features from the target's forward over them), is measured on the same heldout prompts: the difference is what
  regeneration buys.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import polars as pl

from ...config import AcceptanceConfig
from ..hidden_states.shards import HiddenStatesReader
from ..storage.files import write_json
from ..storage.layout import DatasetLayout
from ..target.chat import Answer, ChatTokenizer, TemplateError
from ..tokens.turns import row_prompts


@dataclass
class GateSample:
    id: str
    messages: list[dict[str, Any]]
    input_ids: np.ndarray
    loss_mask: np.ndarray
    source_answer: str | None = None
    aux: Any = None  # the auxiliary hidden states (torch), kept for the samples the draft trains on


@dataclass
class PartMeasure:
    """Acceptance of one draft on a set of prompts."""

    acceptance_length: float
    per_position: list[float]
    n_prompts: int
    n_steps: int
    new_tokens: int

    @classmethod
    def from_rounds(cls, rounds: list[int], k: int, n_prompts: int, new_tokens: int) -> PartMeasure:
        per = []
        for i in range(1, k + 1):
            tried = sum(1 for a in rounds if a >= i - 1)
            per.append(sum(1 for a in rounds if a >= i) / tried if tried else 0.0)
        mean = float(np.mean([a + 1 for a in rounds])) if rounds else 0.0
        return cls(round(mean, 4), [round(p, 4) for p in per], n_prompts, len(rounds), new_tokens)


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


class SpeculativeDecoder:
    """Greedy speculative decoding of the target with an EAGLE-3 draft, counting accepted drafts per forward."""

    def __init__(self, model: Any, feature_ids: Sequence[int], stop_ids: set[int], device: str):
        self.model = model
        self.feature_ids = list(feature_ids)
        self.stop_ids = stop_ids
        self.device = device
        import inspect

        # transformers 5.24 renamed `past_key_values` to `cache`; older versions know only the first.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"

    def _target(self, ids: list[int], cache: Any) -> tuple[Any, Any]:
        import torch

        out = self.model(
            input_ids=torch.tensor([ids], device=self.device),
            **{self._cache_arg: cache},
            use_cache=True,
            output_hidden_states=True,
        )
        hs = out.hidden_states
        feats = torch.cat([hs[j][0] for j in self.feature_ids], -1).float()
        return out.logits[0].argmax(-1), feats

    def decode(self, draft: Any, prompt: list[int], k: int, max_new: int) -> tuple[list[int], list[int]]:
        """Accepted drafts per verifying forward, and the tokens generated (exactly the target's greedy answer,
        whatever the draft proposes: the draft only changes how many forwards it takes)."""
        import torch
        from transformers import DynamicCache

        from .drafter import StepKV

        cache = DynamicCache()
        with torch.no_grad():
            nxt, feats = self._target(prompt, cache)
            tokens = [*prompt, int(nxt[-1])]
            n_new = 1
            # Draft rows 0..p-1: row t holds token t+1 and the target's state at t.
            rows = torch.arange(len(prompt), device=self.device)
            ctx: StepKV | None = None
            last, ctx = self._extend(draft, tokens, feats, rows, ctx)
            rounds: list[int] = []
            while n_new < max_new and tokens[-1] not in self.stop_ids:
                n = len(tokens) - 2  # the last draft row
                drafts = self._draft(draft, last, ctx, tokens[-1], n, k)
                verify, feats = self._target([tokens[-1], *drafts], cache)
                accepted = 0
                while accepted < k and int(verify[accepted]) == drafts[accepted]:
                    accepted += 1
                new = [*drafts[:accepted], int(verify[accepted])]
                rounds.append(accepted)
                for i, t in enumerate(new):  # stop at an end of turn inside what was accepted
                    if t in self.stop_ids:
                        new = new[: i + 1]
                        break
                tokens.extend(new)
                n_new += len(new)
                extra = cache.get_seq_length() - (len(tokens) - 1)  # the rejected drafts' positions
                if extra > 0:
                    cache.crop(-extra)
                rows = torch.arange(n + 1, n + 1 + len(new), device=self.device)
                last, ctx = self._extend(draft, tokens, feats[: len(new)], rows, ctx)
        return rounds, tokens[len(prompt) :]

    def _extend(self, draft: Any, tokens: list[int], feats: Any, rows: Any, ctx: Any) -> tuple[Any, Any]:
        """Step-0 rows for the new positions (token t+1, target state t), appended to the draft's context."""
        import torch

        from .drafter import StepKV

        toks = torch.tensor([tokens[int(t) + 1] for t in rows], device=self.device)
        past = 0 if ctx is None else ctx.k.shape[1]
        n = len(rows)
        mask = torch.ones(n, past + n, dtype=torch.bool, device=self.device)
        mask[:, past:] = torch.tril(mask[:, past:])
        out, kv = draft.step(toks, draft.fc(feats), rows, mask, ctx)
        ctx = kv if ctx is None else StepKV(torch.cat([ctx.k, kv.k], 1), torch.cat([ctx.v, kv.v], 1))
        return out[-1:], ctx

    def _draft(self, draft: Any, last: Any, ctx: Any, bonus: int, n: int, k: int) -> list[int]:
        """k draft tokens after `bonus` (the token at row n + 1): step 0's output, then the chain."""
        import torch

        out = last
        y = int(draft.to_target(draft.logits(out).argmax(-1))[0])
        drafts = [y]
        chain: list[Any] = []
        mask = torch.ones(1, ctx.k.shape[1], dtype=torch.bool, device=self.device)
        for j in range(1, k):
            out, kv = draft.step(
                torch.tensor([y], device=self.device),
                out,
                torch.tensor([n + j], device=self.device),
                mask,
                ctx,
                chain,
            )
            chain.append(kv)
            y = int(draft.to_target(draft.logits(out).argmax(-1))[0])
            drafts.append(y)
        return drafts

    def measure(self, draft: Any, prompts: Sequence[list[int]], k: int, max_new: int) -> PartMeasure:
        rounds: list[int] = []
        new = 0
        for p in prompts:
            r, generated = self.decode(draft, p, k, max_new)
            rounds.extend(r)
            new += len(generated)
        return PartMeasure.from_rounds(rounds, k, len(prompts), new)


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
    """What every draft of one gate run shares: its shape and vocabulary, the target's frozen embedding, the
    speculative decoder that measures it, and the training settings."""

    shape: Any
    embedding: Any
    vocab: Any
    decoder: SpeculativeDecoder
    settings: AcceptanceConfig
    device: str
    log: Callable[[str], None]

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

    def measure(self, draft: Any, prompts: Sequence[list[int]], what: str) -> PartMeasure:
        t0 = time.perf_counter()
        r = self.decoder.measure(
            draft.to(self.device).eval(), prompts, self.settings.draft_tokens, self.settings.max_new_tokens
        )
        self.log(
            f"acceptance: {what}: {r.acceptance_length:.2f} tokens per target forward over {r.n_steps} steps "
            f"({time.perf_counter() - t0:.0f} s)"
        )
        return r


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


def run_gate(
    layout: DatasetLayout,
    settings: AcceptanceConfig,
    model: Any,
    chat: ChatTokenizer,
    device: str,
    log: Callable[[str], None] = print,
) -> GateResult:
    """Train, measure, write <B>/acceptance/report.json and the draft checkpoint, and decide the gate: the verdict
    is computed here, once, and stored in the report (the asset and its check read it)."""
    from ..hidden_states.draft_format import DraftShape, build_draft_vocab, count_tokens
    from ..hidden_states.export import layer_config
    from .drafter import save_checkpoint

    t_start = time.perf_counter()
    k = settings.draft_tokens
    folder = layout.hidden_states_dir
    feature_ids = layer_config(folder, "speculators")["eagle_aux_hidden_state_layer_ids"]
    layer_ids = layer_config(folder, "specforge")["eagle_aux_hidden_state_layer_ids"]
    reader = HiddenStatesReader(folder)
    all_ids = reader.ids()
    train_ids, heldout_ids = split_ids(all_ids, settings.train_prompts, settings.heldout_prompts)
    if not train_ids or not heldout_ids:
        raise ValueError(
            f"{layout.key}: {len(all_ids)} samples with hidden states; the gate needs at least 2 "
            "(some to train on, some held out)"
        )
    window = settings.max_new_tokens + (settings.ttt_steps or k) + 1
    train_samples = load_samples(layout, train_ids, reader, aux_window=window, chat=chat)
    heldout_samples = load_samples(layout, heldout_ids, reader, chat=chat)
    stop_ids = {i for i in (chat.eot_id, chat.tok.eos_token_id) if i is not None}

    # Boundaries, against the template rendered afresh.
    checked = train_samples + heldout_samples
    prompts = rendered_prompts(chat, checked)
    problems = boundary_problems(checked, prompts, stop_ids)
    train_prompts, heldout_prompts = prompts[: len(train_samples)], prompts[len(train_samples) :]

    regenerated = as_train_samples(train_samples, window)
    labels = [s.input_ids[s.loss_mask > 0] for s in train_samples]
    vocab = build_draft_vocab(
        count_tokens(labels), model.config.get_text_config().vocab_size, settings.draft_vocab_size
    )
    bench = DraftBench(
        shape=DraftShape.from_target(model.config, len(vocab)),
        embedding=model.get_input_embeddings().weight.detach().float().cpu(),
        vocab=vocab,
        decoder=SpeculativeDecoder(model, feature_ids, stop_ids, device),
        settings=settings,
        device=device,
        log=log,
    )

    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    untrained = bench.measure(bench.fresh(), heldout_prompts, "untrained draft on heldout prompts")
    seconds["measure_untrained"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    draft, stats = bench.fit(regenerated, "regenerated answers")
    seconds["train"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    # The fit is measured on as many training prompts as are held out (enough to see it, at half the cost).
    train_m = bench.measure(draft, train_prompts[: len(heldout_prompts)], "trained draft on training prompts")
    heldout_m = bench.measure(draft, heldout_prompts, "trained draft on heldout prompts")
    seconds["measure_trained"] = time.perf_counter() - t0
    save_checkpoint(draft, layout.draft_dir, layer_ids, str(getattr(model, "name_or_path", "")))

    source_part: dict[str, Any]
    with_source = [s for s in train_samples if s.source_answer and s.source_answer.strip()]
    if not settings.compare_source_answers:
        source_part = {"skipped": "acceptance.compare_source_answers is false"}
    elif len(with_source) < max(2, len(train_samples) // 2):
        source_part = {
            "skipped": f"{len(with_source)} of {len(train_samples)} training prompts have an answer in the source"
        }
    else:
        t0 = time.perf_counter()
        original = source_samples(with_source, chat, model, feature_ids, device, window)
        src_draft, src_stats = bench.fit(original, "source answers")
        source_part = {
            "n_samples": len(original),
            "heldout": asdict(
                bench.measure(src_draft, heldout_prompts, "source-answer draft on heldout prompts")
            ),
            "train_final_loss": round(src_stats.final_loss, 4),
        }
        seconds["source_answers"] = time.perf_counter() - t0

    seconds["total"] = time.perf_counter() - t_start
    report = {
        "draft_tokens": k,
        "train": asdict(train_m),
        "heldout": asdict(heldout_m),
        "untrained": asdict(untrained),
        "source_answers": source_part,
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
            "checked": len(checked),
            "bad": len(problems),
            "examples": dict(list(problems.items())[:5]),
        },
        "draft": {
            "path": str(layout.draft_dir.relative_to(layout.acceptance_dir)),
            "layout": "SGLang/SpecForge EAGLE-3 draft (LlamaForCausalLMEagle3: config.json + model.safetensors)",
            "eagle_aux_hidden_state_layer_ids": layer_ids,
        },
        "feature_ids_output_hidden_states": list(feature_ids),
        "heldout_ids": heldout_ids,
        "device": device,
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
    samples: Sequence[GateSample],
    chat: ChatTokenizer,
    model: Any,
    feature_ids: Sequence[int],
    device: str,
    window: int,
) -> list[Any]:
    """The dataset's own answers as training samples: tokenized with the target's template, features from the
    target's forward over them (the same independent path the measurement uses)."""
    import torch

    from .drafter import TrainSample

    convs = [(list(s.messages), Answer(str(s.source_answer), None, True)) for s in samples]
    out = []
    for res in chat.tokenize(convs):
        if isinstance(res, TemplateError):
            continue
        ids = torch.from_numpy(res.input_ids.astype(np.int64))
        with torch.no_grad():
            hs = model(input_ids=ids[None].to(device), output_hidden_states=True).hidden_states
        aux = torch.cat([hs[j][0] for j in feature_ids], -1).float().cpu()
        out.append(
            crop_to_window(TrainSample(ids, torch.from_numpy(res.loss_mask.astype(np.int64)), aux), window)
        )
    return out


def read_report(layout: DatasetLayout) -> dict[str, Any] | None:
    path = layout.acceptance_report
    return json.loads(path.read_text()) if path.exists() else None
